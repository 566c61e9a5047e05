"""Families trained under context parallelism (issue #46), at sequences of 32-64 tokens, written as their users
write them: a hand-written Llama calling ``F.scaled_dot_product_attention(is_causal=True)`` with rotary tables
passed to every block, Hugging Face Llama (GQA, rotary; with SDPA, and with its eager attention), Mistral with a
sliding window shorter than the sequence, BERT (bidirectional) with a padding mask, Qwen3, Phi-3, GPT-NeoX and
Gemma 3 (sliding and full layers) with SDPA, Gemma 2 (eager, soft-capped), Falcon and GPT-BigCode (multi-query),
BLOOM (ALiBi, attention as ``baddbmm -> softmax -> bmm``), a hand-written decoder whose attention is ``matmul ->
softmax -> matmul`` under a mask passed into its blocks, Llama on packed documents (position ids restarting per
document: a block-diagonal mask), and three that cp must refuse: nanoGPT's attention written as matmul -> softmax ->
matmul under a mask cut from a buffer by its input's length, a Mamba-style block (a depthwise convolution over time
and a scan), and a mixture-of-experts block that returns its load-balancing loss beside the stream (a function of
all of its positions)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models import DIM, HEADS, LAYERS, MODELS, VOCAB, ListMoE, NanoGPT, TinyLlama

CP_SEQ = 64  # the longest sequence these models take (positions, rotary caches)


def _hf_config(kind: str, **extra):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=CP_SEQ,
                  tie_word_embeddings=False)
    cfg = getattr(transformers, kind)(**{**common, **extra})
    cfg._attn_implementation = "sdpa"
    return cfg


class HFDecoder(nn.Module):
    """A Hugging Face causal LM; ``packed``: each row holds documents of 10, 14 and the remaining tokens, their
    position ids restarting at 0 (transformers turns them into a block-diagonal mask)."""

    def __init__(self, kind: str = "LlamaConfig", packed: bool = False, eager: bool = False, hidden: bool = False,
                 **extra) -> None:
        super().__init__()
        import transformers

        cfg = _hf_config(kind, **extra)
        if eager:
            cfg._attn_implementation = "eager"
        self.model = transformers.AutoModelForCausalLM.from_config(cfg)
        self.packed, self.hidden = packed, hidden

    def forward(self, idx: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.hidden:  # every layer's hidden state read by the loss beside the logits: its last position's (as a
            # sequence classifier pools it) and its root mean square (a mean over positions alone would be the
            # mean of the cp ranks' parts, whole or not)
            out = self.model(input_ids=idx, output_hidden_states=True)
            return out.logits, sum((h[:, -1].pow(2).mean() + h.pow(2).mean().sqrt()) * (i + 1)
                                   for i, h in enumerate(out.hidden_states))
        if not self.packed:
            return self.model(input_ids=idx).logits
        n = idx.shape[1]
        docs = [10, 14, n - 24]
        pos = torch.cat([torch.arange(d, device=idx.device) for d in docs]).expand(idx.shape[0], n)
        return self.model(input_ids=idx, position_ids=pos).logits


class HFBertPadded(nn.Module):
    """BERT (bidirectional attention) with a padding mask: a sample whose first token is ``t`` keeps ``n - 3 * (t % 4)``
    tokens (its tail padded, never attended; read from the sample, so that a replica's part of a batch is masked as
    in the whole batch); trained on the next-token targets like the others."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        import transformers

        cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      max_position_embeddings=CP_SEQ, hidden_dropout_prob=dropout,
                                      attention_probs_dropout_prob=0.0)
        cfg._attn_implementation = "sdpa"
        self.model = transformers.BertForMaskedLM(cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        n = idx.shape[1]
        keep = n - 3 * (idx[:, 0] % 4)
        mask = (torch.arange(n, device=idx.device)[None, :] < keep[:, None]).long()
        return self.model(input_ids=idx, attention_mask=mask).logits


class MatmulAttentionBlock(nn.Module):
    """Attention written by hand, as many research codebases write it: ``q @ k^T`` scaled, the additive mask its caller
    passes, softmax, ``@ v`` (``torch.matmul`` and the operator)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.matmul(q, k.transpose(-2, -1)) / (c // self.heads) ** 0.5 + mask
        y = (att.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.mlp(self.norm2(x))


class MatmulAttentionLM(nn.Module):
    """A decoder of :class:`MatmulAttentionBlock` whose causal mask (positions x positions, additive) is built once
    from the sequence's length outside the blocks and passed to each."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(CP_SEQ, DIM)
        self.blocks = nn.ModuleList([MatmulAttentionBlock(DIM, HEADS) for _ in range(LAYERS)])
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        n = idx.shape[1]
        x = self.embed(idx) + self.pos(torch.arange(n, device=idx.device))
        mask = torch.full((n, n), float("-inf"), device=idx.device).triu(1)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


class MambaStyleBlock(nn.Module):
    """A Mamba-like mixer: in-projection, a causal depthwise convolution over time, a diagonal scan, out-projection."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.in_proj = nn.Linear(dim, 2 * dim)
        self.conv1d = nn.Conv1d(dim, dim, kernel_size=4, groups=dim, padding=3)
        self.A_log = nn.Parameter(torch.zeros(dim))
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, z = self.in_proj(self.norm(x)).chunk(2, dim=-1)
        u = self.conv1d(u.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)
        decay, h, out = torch.sigmoid(-self.A_log.exp()), torch.zeros_like(u[:, 0]), []
        for t in range(u.shape[1]):
            h = decay * h + u[:, t]
            out.append(h)
        return x + self.out_proj(torch.stack(out, 1) * F.silu(z))


class MambaStyleLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([MambaStyleBlock(DIM) for _ in range(LAYERS)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class AuxMoEBlock(nn.Module):
    """Pre-norm attention (SDPA, causal) and a mixture of experts whose Switch load-balancing loss is added to the
    running total carried beside the stream (as litgpt-style hand-written MoE models do)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.moe = ListMoE(DIM)

    def forward(self, x: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, HEADS, C // HEADS).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))
        y, a = self.moe(self.norm2(x))
        return x + y, aux + a


class AuxMoELM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([AuxMoEBlock() for _ in range(LAYERS)])
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, aux = self.embed(idx), torch.zeros((), device=idx.device)
        for block in self.blocks:
            x, aux = block(x, aux)
        return self.head(x), aux


MODELS.update({
    "cp_llama": TinyLlama,  # hand-written: SDPA is_causal, rotary tables (positions x dim) given to every block
    "cp_llama4": lambda: TinyLlama(n_layers=4),
    "cp_hf_llama": lambda: HFDecoder("LlamaConfig"),
    "cp_hf_llama_eager": lambda: HFDecoder("LlamaConfig", eager=True),  # matmul -> softmax -> matmul, HF's own
    "cp_hf_mistral": lambda: HFDecoder("MistralConfig", sliding_window=8),
    "cp_hf_packed": lambda: HFDecoder("LlamaConfig", packed=True),
    "cp_hf_llama_hidden": lambda: HFDecoder("LlamaConfig", hidden=True),  # output_hidden_states=True, read by the loss
    # with SDPA, as transformers loads them by default: per-head query/key norms (Qwen3), fused qkv (Phi-3), per-head
    # fused qkv and partial rotary (GPT-NeoX), sliding and full layers alternating, window 8 (Gemma 3)
    "cp_hf_qwen3": lambda: HFDecoder("Qwen3Config"),
    "cp_hf_phi3": lambda: HFDecoder("Phi3Config", pad_token_id=0),
    "cp_hf_neox": lambda: HFDecoder("GPTNeoXConfig"),
    "cp_hf_gemma3": lambda: HFDecoder("Gemma3TextConfig", head_dim=DIM // HEADS, sliding_window=8,
                                      layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2)
                                      + ["sliding_attention"] * (LAYERS % 2)),
    # eager attention with logit soft-capping, sliding (window 8) and global layers (Gemma 2); a new-architecture
    # Falcon with 2 key/value heads; GPT-BigCode with one key/value head (multi-query)
    "cp_hf_gemma2": lambda: HFDecoder("Gemma2Config", eager=True, head_dim=DIM // HEADS,
                                      query_pre_attn_scalar=DIM // HEADS, sliding_window=8),
    "cp_hf_falcon": lambda: HFDecoder("FalconConfig", new_decoder_architecture=True, num_kv_heads=2),
    "cp_hf_bigcode": lambda: HFDecoder("GPTBigCodeConfig", multi_query=True, attn_pdrop=0.0, resid_pdrop=0.0,
                                       embd_pdrop=0.0),
    # ALiBi (a per-head slope times the key's position, added by baddbmm), attention as matmul -> softmax -> matmul
    "cp_hf_bloom": lambda: HFDecoder("BloomConfig", eager=True, n_head=HEADS, n_layer=LAYERS, attention_dropout=0.0,
                                     hidden_dropout=0.0),
    "cp_matmul": MatmulAttentionLM,  # attention by hand (matmul -> softmax -> matmul), its mask passed in
    "cp_hf_bert": HFBertPadded,
    "cp_hf_bert_dropout": lambda: HFBertPadded(dropout=0.5),  # BERT's default is 0.1; 0.5 for a clear mask
    "cp_nanogpt": lambda: NanoGPT(block_size=CP_SEQ),  # matmul -> softmax -> matmul, mask cut by [:T, :T]: refused
    "cp_mamba": MambaStyleLM,  # a convolution over time and a scan: refused
    "cp_aux_moe": AuxMoELM,  # a load-balancing loss computed over a block's positions, returned beside it: refused
})
