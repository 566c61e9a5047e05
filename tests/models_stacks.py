"""Stacks other than one list of same-class layers, written as their users write them (issue #44 item 2): layers of
two classes in one ``nn.ModuleList`` (a hand-written hybrid, Hugging Face's Jamba: Mamba and attention layers, MoE
every other layer), blocks in an ``nn.ModuleDict``, and two stacks (LLaVA: a CLIP vision tower whose second-to-last
layer's hidden states, captured by Hugging Face's hooks, feed a Llama). They register in ``models.MODELS``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models import DIM, HEADS, MODELS, SEQ, VOCAB


class GatedConvBlock(nn.Module):
    """A Mamba-like mixer stand-in: gated depthwise causal conv (another class than the attention block)."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.in_proj = nn.Linear(dim, 2 * dim)
        self.conv = nn.Conv1d(dim, dim, 3, groups=dim, padding=2)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, g = self.in_proj(self.norm(x)).chunk(2, -1)
        h = self.conv(h.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        return x + self.out_proj(F.silu(g) * h)


class AttnBlock(nn.Module):
    def __init__(self, dim: int = DIM, heads: int = HEADS) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(x)


class HybridLM(nn.Module):
    """Layers of two classes in one ModuleList (conv mixers and attention), as hybrid models hold them."""

    def __init__(self, pattern: str = "ccac") -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([AttnBlock() if k == "a" else GatedConvBlock() for k in pattern])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class DictLM(nn.Module):
    """Blocks kept in an nn.ModuleDict by name, run in its order."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleDict({f"block_{i}": AttnBlock() for i in range(4)})
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for _, block in self.blocks.items():
            x = block(x)
        return self.head(x)


class HFJamba(nn.Module):
    """Jamba: Mamba mixers (a parent reading its conv's weight functionally) and attention layers in one list."""

    def __init__(self) -> None:
        super().__init__()
        import transformers
        cfg = transformers.JambaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM,
                                       num_hidden_layers=4, num_attention_heads=HEADS, num_key_value_heads=2,
                                       attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                                       expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
                                       mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
                                       use_mamba_kernels=False, tie_word_embeddings=False,
                                       max_position_embeddings=SEQ)
        self.model = transformers.JambaForCausalLM(cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx).logits


class HFLlava(nn.Module):
    """LLaVA: an 8 x 8 picture (from the first token ids) through CLIP, its layer -2 projected into a Llama."""

    def __init__(self) -> None:
        super().__init__()
        import transformers
        vision = transformers.CLIPVisionConfig(hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=2,
                                               num_attention_heads=HEADS, image_size=8, patch_size=4,
                                               projection_dim=DIM)
        text = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM,
                                        num_hidden_layers=4, num_attention_heads=HEADS, num_key_value_heads=2,
                                        max_position_embeddings=64, tie_word_embeddings=False)
        cfg = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_id=VOCAB - 1,
                                       vision_feature_layer=-2, projector_hidden_act="gelu",
                                       vision_feature_select_strategy="full")
        self.model = transformers.LlavaForConditionalGeneration(cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B = idx.shape[0]
        pixels = (idx[:, :8].float() / VOCAB)[:, None, :, None].expand(B, 3, 8, 8).contiguous()
        ids = idx % (VOCAB - 1)  # the last id is the image token
        ids[:, :5] = VOCAB - 1  # (8 / 4)^2 patches and the CLS token ("full" keeps it): 5 image positions
        return self.model(input_ids=ids, pixel_values=pixels).logits


class FusedGLUBlock(nn.Module):
    """Attention and a gated MLP whose gate and up projections are one ``Linear(d, 2 h)``, split by ``chunk`` (how
    hand-written SwiGLU blocks and ModernBERT's ``Wi`` fuse them), plus a slicing variant."""

    def __init__(self, dim: int = DIM, heads: int = HEADS, sliced: bool = False) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.w12, self.w3 = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(2 * dim, dim, bias=False)
        self.sliced = sliced

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn_norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        gate_up = self.w12(self.mlp_norm(x))
        if self.sliced:
            half = gate_up.shape[-1] // 2
            gate, up = gate_up[..., :half], gate_up[..., half:]
        else:
            gate, up = gate_up.chunk(2, dim=-1)
        return x + self.w3(F.silu(gate) * up)


class FusedGLULM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([FusedGLUBlock(sliced=i % 2 == 1) for i in range(2)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class HFMidLayer(nn.Module):
    """A Llama whose output adds the LM head's view of a middle layer (deep supervision), read from
    ``output_hidden_states``: a layer of the first stage, captured by a hook, used on the last."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM,
                                       num_hidden_layers=4, num_attention_heads=HEADS, num_key_value_heads=2,
                                       max_position_embeddings=SEQ, tie_word_embeddings=False)
        self.model = transformers.LlamaForCausalLM(cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=idx, output_hidden_states=True)
        middle = self.model.lm_head(self.model.model.norm(out.hidden_states[2]))  # after layers 0 and 1
        return out.logits + 0.5 * middle


class Mamba2Mixer(nn.Module):
    """A Mamba-2 mixer as users write it from the paper (mamba_ssm's ``Mamba2Simple`` names, a plain sequential scan
    instead of its kernels): one input projection to ``[z | x | B | C | dt]``, a depthwise causal conv over
    ``[x | B | C]``, per-head ``A_log`` / ``D`` / ``dt_bias``, a gated RMSNorm in groups, an output projection."""

    def __init__(self, d_model: int = DIM, d_state: int = 8, headdim: int = 8, ngroups: int = 2, expand: int = 2,
                 d_conv: int = 4) -> None:
        super().__init__()
        self.d_inner, self.d_state, self.headdim, self.ngroups = expand * d_model, d_state, headdim, ngroups
        self.nheads = self.d_inner // headdim
        conv_dim = self.d_inner + 2 * ngroups * d_state
        self.in_proj = nn.Linear(d_model, 2 * self.d_inner + 2 * ngroups * d_state + self.nheads, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, d_conv, groups=conv_dim, padding=d_conv - 1)
        self.dt_bias = nn.Parameter(torch.linspace(-1.0, 0.5, self.nheads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.nheads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(self.nheads))
        self.norm_weight = nn.Parameter(torch.ones(self.d_inner))
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        b, length, _ = u.shape
        zxbcdt = self.in_proj(u)
        if "mup" in self._buffers:  # Falcon-H1's multipliers of the projection's parts (a subclass registers them)
            zxbcdt = zxbcdt * self.mup
        z, xbc, dt = torch.split(zxbcdt, [self.d_inner, self.d_inner + 2 * self.ngroups * self.d_state, self.nheads],
                                 dim=-1)
        xbc = F.silu(self.conv1d(xbc.transpose(1, 2))[..., :length].transpose(1, 2))
        x, B, C = torch.split(xbc, [self.d_inner, self.ngroups * self.d_state, self.ngroups * self.d_state], dim=-1)
        x = x.view(b, length, self.nheads, self.headdim)
        per_group = self.nheads // self.ngroups
        B = B.view(b, length, self.ngroups, self.d_state).repeat_interleave(per_group, dim=2)
        C = C.view(b, length, self.ngroups, self.d_state).repeat_interleave(per_group, dim=2)
        dt = F.softplus(dt + self.dt_bias)  # (b, l, h)
        A = -torch.exp(self.A_log)
        state = x.new_zeros(b, self.nheads, self.headdim, self.d_state)
        ys = []
        for t in range(length):
            decay = torch.exp(dt[:, t] * A)[:, :, None, None]
            state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
            ys.append((state * C[:, t, :, None, :]).sum(-1) + self.D[:, None] * x[:, t])
        y = torch.stack(ys, dim=1).reshape(b, length, self.d_inner) * F.silu(z)
        groups = y.view(b, length, self.ngroups, -1)
        y = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + 1e-6)).view(b, length, -1)
        return self.out_proj(y * self.norm_weight)


class Mamba2LM(nn.Module):
    """Hand-written Mamba-2 blocks (pre-norm residual) with MLPs between, an embedding and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norms = nn.ModuleList([nn.LayerNorm(DIM) for _ in range(2)])
        self.mixers = nn.ModuleList([Mamba2Mixer() for _ in range(2)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for norm, mixer in zip(self.norms, self.mixers):
            x = x + mixer(norm(x))
        return self.head(x)


class HFBamba(nn.Module):
    """Hugging Face's Bamba: Mamba-2 mixers (two groups of B/C) and attention in one list."""

    def __init__(self) -> None:
        super().__init__()
        import transformers
        cfg = transformers.BambaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM,
                                       num_hidden_layers=4, num_attention_heads=HEADS, num_key_value_heads=2,
                                       attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2,
                                       mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
                                       max_position_embeddings=SEQ, tie_word_embeddings=False)
        self.model = transformers.BambaForCausalLM(cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx).logits


class HFMamba(nn.Module):
    """Hugging Face's Mamba (Mamba-1 mixers: x_proj and dt_proj, per-channel A and D)."""

    def __init__(self) -> None:
        super().__init__()
        import transformers
        cfg = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=4, state_size=8,
                                       expand=2, time_step_rank=8, conv_kernel=4, tie_word_embeddings=False)
        self.model = transformers.MambaForCausalLM(cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx).logits


MODELS.update({"fused_glu": FusedGLULM, "hf_mid_layer": HFMidLayer, "hybrid": HybridLM, "dict_blocks": DictLM, "hf_jamba": HFJamba, "hf_llava": HFLlava,
               "mamba2": Mamba2LM, "hf_bamba": HFBamba, "hf_mamba": HFMamba})


# ---- per-head parameters and side tensors under tp (issue 47 item 3) ----------------------------------------------
class HFBloom(nn.Module):
    """Hugging Face's BLOOM: ALiBi slopes built from the head count by the model, outside its attention blocks, and
    passed to each as a ``(batch * heads, 1, keys)`` tensor that ``baddbmm`` adds to the scores; a fused per-head
    ``query_key_value`` ([q, k, v] per head)."""

    def __init__(self) -> None:
        super().__init__()
        import transformers
        cfg = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=DIM, n_layer=2, n_head=HEADS,
                                       hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False)
        self.model = transformers.BloomForCausalLM(cfg)
        self.model.config._attn_implementation = "eager"

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx).logits


class SinkAttention(nn.Module):
    """gpt-oss's attention as its users write it: grouped-query heads, and one learned sink logit per head joined to
    each row of scores before the softmax and dropped after (``mix`` other than "sinks": a length-``heads`` vector
    read another way, over the output's first features, not per head; ``needs_mask``: a forward that takes its mask,
    so that it cannot be traced on made-up inputs at setup)."""

    def __init__(self, dim: int = DIM, heads: int = HEADS, kv_heads: int = 2, mix: str = "sinks",
                 needs_mask: bool = False) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.mix = heads, kv_heads, dim // heads, mix
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.sinks = nn.Parameter(torch.randn(heads))
        self.needs_mask = needs_mask

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        scores = q @ k.transpose(-1, -2) / self.head_dim ** 0.5
        if mask is None and self.needs_mask:
            raise ValueError("a mask is needed")  # (as rotary tables are): made-up inputs cannot run it
        if mask is None:
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        if self.mix == "sinks":
            sinks = self.sinks.view(1, -1, 1, 1).expand(b, -1, t, 1)
            probs = torch.cat([scores, sinks], dim=-1).softmax(dim=-1)[..., :-1]
        else:
            probs = scores.softmax(dim=-1)
        out = self.o((probs @ v).transpose(1, 2).reshape(b, t, -1))
        if self.mix != "sinks":  # the same vector over the first features: not per head
            out = torch.cat([out[..., :self.heads] * self.sinks, out[..., self.heads:]], dim=-1)
        return out


class SinkBlock(nn.Module):
    def __init__(self, **kw: object) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = SinkAttention(**kw)  # type: ignore[arg-type]
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        x = x + self.attn(self.norm1(x), mask)
        return x + self.mlp(self.norm2(x))


class SinkLM(nn.Module):
    def __init__(self, layers: int = 2, **kw: object) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList([SinkBlock(**kw) for _ in range(layers)])
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


MODELS.update({"hf_bloom": HFBloom, "sink_attention": SinkLM,
               "sink_attention4": lambda: SinkLM(layers=4),
               "sink_mixed_untraced": lambda: SinkLM(mix="features", needs_mask=True)})
