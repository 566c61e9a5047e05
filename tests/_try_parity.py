"""Scratch (not a test): run a layout for some models and compare with one process. Usage:
python tests/_try_parity.py MODELS N_PROCS [parity.py args...]"""
import sys, tempfile
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from launch import ROOT, run_ranks
from parity import assert_parity, load_record, train, merge_stages

models, n, extra = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3:]
tmp = Path(tempfile.mkdtemp())
res = run_ranks(ROOT / "tests" / "parity.py", n, ["--models", ",".join(models), "--out", str(tmp), *extra], timeout=600)
if res.timed_out or any(res.returncodes):
    print(res.outputs[0][-5000:]); print("=== rank1"); print(res.outputs[-1][-3000:]); sys.exit(1)
print(res.outputs[0][-3000:])
pp = int(extra[extra.index("--pp") + 1]) if "--pp" in extra else 1
dp = int(extra[extra.index("--dp") + 1]) if "--dp" in extra else 1
for name in models:
    ref = train(name, dp=dp)
    recs = [load_record(tmp / f"{name}.rank{r}.pt") for r in range(n)]
    print(name, "ref", [round(x, 5) for x in ref.losses], "got", [round(x, 5) for x in recs[0].losses],
          "fraction", [round(r.local_fraction, 3) for r in recs])
    try:
        if pp > 1:
            tp = n // pp // dp
            for t in range(tp):
                assert_parity(merge_stages([recs[r] for r in range(n) if r % tp == t]), ref, where=name)
        else:
            for r in recs:
                assert_parity(r, ref, where=name)
        print(name, "PARITY OK")
    except AssertionError as e:
        print(name, "PARITY FAIL", str(e)[:600])
