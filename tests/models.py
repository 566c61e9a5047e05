"""Tiny models written the way their users write them (no knowledge of lightning_tpp), one per pattern.

Each factory takes a seed-free config and returns an ``nn.Module`` mapping token ids ``(B, T)`` to logits
``(B, T, V)``. :class:`LitLM` wraps any of them in an ordinary LightningModule.
"""

from __future__ import annotations

import math
from typing import Callable

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, LAYERS, SEQ = 64, 32, 4, 2, 16


# ---- nanoGPT style: fused c_attn, split(n_embd), view with C from the input, tied wte/lm_head -------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab: int = VOCAB, n_embd: int = DIM, n_head: int = HEADS, n_layer: int = LAYERS,
                 block_size: int = SEQ) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head, block_size) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


# ---- Llama style: separate q/k/v/o with grouped-query attention, rotary, RMSNorm, SwiGLU, untied head ------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:  # torch's convention (nn.RMSNorm has it): lets a meta-built model initialise
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.feed_forward = FeedForward(dim, 3 * dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class TinyLlama(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM, n_heads: int = HEADS, n_kv_heads: int = 2,
                 n_layers: int = LAYERS) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([LlamaBlock(dim, n_heads, n_kv_heads) for _ in range(n_layers)])
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.head_dim = dim // n_heads

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = torch.arange(tokens.shape[1], dtype=torch.float32, device=tokens.device)
        inv = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2, device=tokens.device).float() / self.head_dim))
        freqs = torch.outer(t, inv)
        cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


# ---- fused grouped-query qkv: one projection of (n_head + 2 n_kv) * head_dim, split by sizes ----------------------
class FusedGQAAttention(nn.Module):
    def __init__(self, dim: int, n_head: int, n_kv_head: int) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, dim // n_head
        self.qkv = nn.Linear(dim, (n_head + 2 * n_kv_head) * self.head_dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim], dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class FusedGQAModel(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM, n_head: int = HEADS, n_kv_head: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norms = nn.ModuleList([nn.LayerNorm(dim) for _ in range(LAYERS)])
        self.attns = nn.ModuleList([FusedGQAAttention(dim, n_head, n_kv_head) for _ in range(LAYERS)])
        self.mlps = nn.ModuleList([nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))
                                   for _ in range(LAYERS)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for norm, attn, mlp in zip(self.norms, self.attns, self.mlps):
            x = x + attn(norm(x))
            x = x + mlp(x)
        return self.head(x)


# ---- built on nn.TransformerEncoder (nn.MultiheadAttention inside) --------------------------------------------------
class EncoderLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM, heads: int = HEADS) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1], device=idx.device)
        return self.head(self.encoder(self.embed(idx), mask=mask, is_causal=True))


# ---- encoder-decoder: nn.Transformer ------------------------------------------------------------------------------
class Seq2Seq(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM, heads: int = HEADS) -> None:
        super().__init__()
        self.src_embed, self.tgt_embed = nn.Embedding(vocab, dim), nn.Embedding(vocab, dim)
        self.transformer = nn.Transformer(dim, heads, num_encoder_layers=LAYERS, num_decoder_layers=LAYERS,
                                          dim_feedforward=2 * dim, dropout=0.0, batch_first=True)
        self.out = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1], device=idx.device)
        return self.out(self.transformer(self.src_embed(idx), self.tgt_embed(idx), tgt_mask=mask, tgt_is_causal=True))


# ---- conditioning: a vector computed by its own MLP before the blocks and read by every block (DiT/adaLN style) ---
class AdaLNBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.modulation = nn.Linear(dim, 2 * dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        shift, scale = self.modulation(c).unsqueeze(1).chunk(2, dim=-1)
        h = self.norm(x) * (1 + scale) + shift
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm(x) * (1 + scale) + shift)


class ConditionedLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM, heads: int = HEADS, n_layers: int = LAYERS) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.cond = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList([AdaLNBlock(dim, heads) for _ in range(n_layers)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        c = self.cond(x[:, 0])  # conditioned on the first token, like a class label
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1], device=idx.device)
        for block in self.blocks:
            x = block(x, c, mask)
        return self.head(x)


# ---- x-transformers / lucidrains style: a list of [attention, feed-forward] lists, unpacked in the loop ----------
class PreNormResidual(nn.Module):
    def __init__(self, dim: int, fn: nn.Module) -> None:
        super().__init__()
        self.norm, self.fn = nn.LayerNorm(dim), fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fn(self.norm(x))


class NestedListLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([
            nn.ModuleList([PreNormResidual(dim, nn.Sequential(nn.Linear(dim, dim), nn.Tanh())),
                           PreNormResidual(dim, nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(),
                                                              nn.Linear(4 * dim, dim)))])
            for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(dim)
        self.to_logits = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for mix, ff in self.layers:
            x = ff(mix(x))
        return self.to_logits(self.norm(x))


# ---- a parameter owned by the model itself (a ViT's pos_embed / cls_token), used before the blocks -------------
class RootParamLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM) -> None:
        super().__init__()
        self.pos_embed = nn.Parameter(torch.randn(SEQ, dim) * 0.02)
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([PreNormResidual(dim, nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(),
                                                                        nn.Linear(2 * dim, dim)))
                                     for _ in range(LAYERS)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos_embed[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# ---- Hugging Face T5: encoder-decoder, shared embedding called by both stacks, relative position bias -----------
class HFT5(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        import transformers

        cfg = transformers.T5Config(vocab_size=VOCAB, d_model=DIM, d_kv=DIM // HEADS, d_ff=2 * DIM,
                                    num_layers=LAYERS, num_decoder_layers=LAYERS, num_heads=HEADS, dropout_rate=0.0,
                                    decoder_start_token_id=0, pad_token_id=0, tie_word_embeddings=True)
        self.model = transformers.T5ForConditionalGeneration(cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx, decoder_input_ids=idx).logits


class HFBart(nn.Module):
    """BART: learned positions and an embedding layer norm in each stack, shared token embedding."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        cfg = transformers.BartConfig(vocab_size=VOCAB, d_model=DIM, encoder_layers=LAYERS, decoder_layers=LAYERS,
                                      encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
                                      encoder_ffn_dim=2 * DIM, decoder_ffn_dim=2 * DIM, max_position_embeddings=SEQ,
                                      dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
        self.model = transformers.BartForConditionalGeneration(cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx, decoder_input_ids=idx).logits


# ---- Hugging Face transformers, tiny random configs ----------------------------------------------------------------
class HFCausalLM(nn.Module):
    def __init__(self, kind: str, kv_heads: int = 2) -> None:
        super().__init__()
        import transformers

        if kind == "gpt2":
            cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=DIM, n_layer=LAYERS, n_head=HEADS,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
            cfg._attn_implementation = "eager"
            self.model = transformers.GPT2LMHeadModel(cfg)
        else:
            cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM,
                                           num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=kv_heads,
                                           max_position_embeddings=SEQ, tie_word_embeddings=False)
            cfg._attn_implementation = "sdpa"
            self.model = transformers.LlamaForCausalLM(cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx).logits


class HFCausalLMFamily(nn.Module):
    """Other Hugging Face decoder-only families, tiny random configs: fused per-head qkv (GPT-NeoX), fused qkv and
    gate/up projections (Phi-3), GQA with rotary and qkv biases (Qwen2), per-head query/key norms (Qwen3), norms over
    all query/key features (OLMo-2), tied and scaled embeddings (Gemma); and an
    encoder-only masked LM (BERT), trained here on the same next-token targets."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        import transformers

        common = dict(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, max_position_embeddings=SEQ, tie_word_embeddings=False)
        if kind == "neox":
            cfg = transformers.GPTNeoXConfig(**common, rotary_pct=0.5, use_parallel_residual=True)
            self.model = transformers.GPTNeoXForCausalLM(cfg)
        elif kind == "gemma":  # tied, and a scaled embedding (a subclass with its own forward)
            cfg = transformers.GemmaConfig(**{**common, "tie_word_embeddings": True}, num_key_value_heads=2,
                                           head_dim=DIM // HEADS)
            self.model = transformers.GemmaForCausalLM(cfg)
        elif kind == "bert":  # an encoder-only masked LM: attention spread over self/output children, tied decoder
            cfg = transformers.BertConfig(**{**common, "tie_word_embeddings": True}, hidden_dropout_prob=0.0,
                                          attention_probs_dropout_prob=0.0)
            self.model = transformers.BertForMaskedLM(cfg)
        elif kind == "phi3":
            cfg = transformers.Phi3Config(**common, num_key_value_heads=2, pad_token_id=0)
            self.model = transformers.Phi3ForCausalLM(cfg)
        elif kind == "qwen3":  # an RMSNorm over head_dim on each query and key head: replicated, used on local heads
            cfg = transformers.Qwen3Config(**common, num_key_value_heads=2, head_dim=DIM // HEADS)
            self.model = transformers.Qwen3ForCausalLM(cfg)
        elif kind == "olmo2":  # an RMSNorm over all query (key) features: needs every head at once
            cfg = transformers.Olmo2Config(**common, num_key_value_heads=HEADS, pad_token_id=0, eos_token_id=1,
                                           bos_token_id=None)
            self.model = transformers.Olmo2ForCausalLM(cfg)
        else:
            cfg = transformers.Qwen2Config(**common, num_key_value_heads=2)
            self.model = transformers.Qwen2ForCausalLM(cfg)
        self.model.config._attn_implementation = "eager"

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx).logits


class PostNormBlock(nn.Module):
    """An MLP block that normalises its own output. Under sequence parallelism the norm runs on the row layer's
    reduce-scattered shard, inside the tensor-parallel block, so its gradient on each rank is a part: the forward
    check cannot see that, the gradient check finds it (the parts sum to the whole) and training sums it over tp."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim), nn.LayerNorm(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class PostNormLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB)
        self.blocks = nn.ModuleList([PostNormBlock() for _ in range(LAYERS)])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class HFViT(nn.Module):
    """A Hugging Face vision transformer classifying a 4 x 4 one-channel image (the token ids, scaled) into VOCAB
    classes from its CLS token: patch convolution, CLS token and position embeddings, blocks, final norm, classifier.
    """

    def __init__(self) -> None:
        super().__init__()
        import transformers

        cfg = transformers.ViTConfig(image_size=4, patch_size=1, num_channels=1, hidden_size=DIM,
                                     num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=2 * DIM,
                                     num_labels=VOCAB, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        cfg._attn_implementation = "eager"
        self.model = transformers.ViTForImageClassification(cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pixels = (idx.float() / VOCAB).view(idx.shape[0], 1, 4, 4)
        return self.model(pixel_values=pixels).logits  # (batch, VOCAB): one class per image


def LitGPTModel() -> nn.Module:
    """Lightning's own model library: litgpt's ``GPT`` (a Llama-like config: RMSNorm, SwiGLU, GQA with fused qkv,
    rotary), whose ``lm_head`` is registered before ``transformer`` (embedding, blocks, final norm)."""
    from litgpt.config import Config
    from litgpt.model import GPT

    return GPT(Config(block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=LAYERS, n_head=HEADS,
                      n_embd=DIM, n_query_groups=2, rotary_percentage=1.0, parallel_residual=False, bias=False,
                      norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=2 * DIM))


# ---- a hand-written GPT whose block holds its projections directly; heads only in view(B, S, -1, head_dim) -------
class FlatBlock(nn.Module):
    def __init__(self, dim: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        h = self.ln1(x)
        q = self.q(h).view(B, S, -1, self.head_dim).transpose(1, 2)
        k = self.k(h).view(B, S, -1, self.head_dim).transpose(1, 2)
        v = self.v(h).view(B, S, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, S, -1))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class MaskBlock(FlatBlock):
    """FlatBlock with attention written by hand and its causal mask made where it is used, with no device named (on a
    CPU run: the CPU, as one process runs it; a pipeline stage infers the shapes of a block it does not hold on
    meta)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        h = self.ln1(x)
        q, k, v = (layer(h).view(B, S, -1, self.head_dim).transpose(1, 2) for layer in (self.q, self.k, self.v))
        att = (q @ k.transpose(-2, -1)) * self.head_dim ** -0.5
        att = att.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        x = x + self.o((att @ v).transpose(1, 2).reshape(B, S, -1))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


# ---- attention spread over siblings: q/k/v in one child, the attention maths in another, the output at the block --
class QKV(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.to_q(x), self.to_k(x), self.to_v(x)


class Attend(nn.Module):
    def __init__(self, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, S, D = q.shape
        q, k, v = (t.reshape(B, S, self.n_head, D // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D // self.n_head)
        att = att.masked_fill(torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        return (att.softmax(-1) @ v).transpose(1, 2).reshape(B, S, D)


class SplitBlock(nn.Module):
    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.attend, self.proj = QKV(dim), Attend(n_head), nn.Linear(dim, dim)
        self.fc_in, self.fc_out = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(self.attend(*self.qkv(self.norm1(x))))
        return x + self.fc_out(torch.relu(self.fc_in(self.norm2(x))))


class BlockGPT(nn.Module):
    """Learned positions, a list of blocks of any of the classes above, a final norm and a separate head."""

    def __init__(self, block: Callable[[], nn.Module], vocab: int = VOCAB, dim: int = DIM, n_layers: int = LAYERS
                 ) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(SEQ, dim)
        self.blocks = nn.ModuleList([block() for _ in range(n_layers)])
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ---- mixtures of experts ------------------------------------------------------------------------------------------
class HFMoE(nn.Module):
    """Hugging Face mixture-of-experts families, tiny random configs, the load-balancing loss on (the model's own loss,
    ``labels=``): 3-D expert banks in every family (transformers 5). Mixtral (top-2 of 4, softmax then top-k),
    Qwen2-MoE (a shared expert with a sigmoid gate beside the routed ones), DeepSeek-V3 (a dense first layer, shared
    experts, sigmoid scores with group-limited routing and a score-correction bias, MLA attention), gpt-oss (transposed
    banks with biases, interleaved gate/up pairs, a clamped activation, attention sinks), GraniteMoE (banks that its
    files hold under other names: ``input_linear``, ``output_linear``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        import transformers

        common = dict(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=False,
                      output_router_logits=True, router_aux_loss_coef=0.02)
        if kind in ("mixtral", "mixtral_two"):  # two experts, top-1: at ep2, fewer experts per rank than replicas
            two = kind == "mixtral_two"
            cfg = transformers.MixtralConfig(**common, intermediate_size=2 * DIM, num_local_experts=2 if two else 4,
                                             num_experts_per_tok=1 if two else 2)
            self.model = transformers.MixtralForCausalLM(cfg)
        elif kind == "qwen2_moe":
            cfg = transformers.Qwen2MoeConfig(**common, intermediate_size=2 * DIM, moe_intermediate_size=DIM,
                                              shared_expert_intermediate_size=2 * DIM, num_experts=4,
                                              num_experts_per_tok=2, norm_topk_prob=True)
            self.model = transformers.Qwen2MoeForCausalLM(cfg)
        elif kind in ("gpt_oss", "gpt_oss_one_expert"):  # transposed banks with biases, interleaved gate/up, clamp
            one = kind == "gpt_oss_one_expert"
            cfg = transformers.GptOssConfig(**{**common, "num_key_value_heads": 2}, intermediate_size=DIM,
                                            num_local_experts=4, num_experts_per_tok=1 if one else 2,
                                            head_dim=DIM // HEADS, layer_types=["full_attention"] * LAYERS,
                                            sliding_window=SEQ)
            self.model = transformers.GptOssForCausalLM(cfg)
            if one:  # the router's bias sends every token to the last expert: the others get none, anywhere
                for layer in self.model.model.layers:
                    with torch.no_grad():
                        layer.mlp.router.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 100.0]))
        elif kind == "granitemoe":
            cfg = transformers.GraniteMoeConfig(**common, intermediate_size=DIM, num_local_experts=4,
                                                num_experts_per_tok=2)
            self.model = transformers.GraniteMoeForCausalLM(cfg)
        else:
            cfg = transformers.DeepseekV3Config(**{**common, "num_hidden_layers": 3, "num_key_value_heads": HEADS},
                                                intermediate_size=2 * DIM,
                                                moe_intermediate_size=DIM, n_routed_experts=4, n_shared_experts=1,
                                                num_experts_per_tok=2, n_group=2, topk_group=1,
                                                first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                                                qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
            self.model = transformers.DeepseekV3ForCausalLM(cfg)
        self.model.config._attn_implementation = "eager"

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx).logits


class SwiGLUExpert(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ListMoE(nn.Module):
    """Experts held as an ``nn.ModuleList`` and run in a loop over the experts that got tokens (older Hugging Face
    code, litgpt's LLaMAMoE); a gated shared expert; the Switch load-balancing loss kept for the model's loss."""

    def __init__(self, dim: int, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList([SwiGLUExpert(dim, dim) for _ in range(experts)])
        self.shared_expert = SwiGLUExpert(dim, 2 * dim)
        self.shared_gate = nn.Linear(dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1, x.shape[-1])
        probs = self.gate(flat).softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            if len(token):
                out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        out = out + torch.sigmoid(self.shared_gate(flat)) * self.shared_expert(flat)
        counts = F.one_hot(chosen, len(self.experts)).float().sum(dim=(0, 1)) / chosen.numel()
        aux = len(self.experts) * (counts * probs.mean(dim=0)).sum()
        return out.view_as(x), aux


class ListMoEBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, SEQ)
        self.moe = ListMoE(dim)

    def forward(self, x: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.norm1(x))
        y, a = self.moe(self.norm2(x))
        return x + y, aux + a


class ListMoELM(nn.Module):
    """A decoder whose blocks carry the running load-balancing loss beside the stream; returns (logits, aux)."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, heads: int = HEADS, n_layers: int = LAYERS) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([ListMoEBlock(dim, heads) for _ in range(n_layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, aux = self.embed(idx), torch.zeros((), device=idx.device)
        for block in self.blocks:
            x, aux = block(x, aux)
        return self.head(self.norm(x)), aux


# ---- batch statistics under micro-batching (issue #30 item 4): a small ResNet classifier --------------------------
class ResidualBlock(nn.Module):
    """conv -> BatchNorm -> ReLU -> conv -> BatchNorm, plus the input."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels, momentum=None)  # cumulative average: reads num_batches_tracked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class TinyResNet(nn.Module):
    """Classifies a 4 x 4 one-channel image (the token ids, scaled) into VOCAB classes: a stem convolution, an
    InstanceNorm that tracks running statistics and a BatchNorm (units of the pipeline by themselves), residual
    blocks, pooling and a linear head."""

    def __init__(self, channels: int = 4, n_blocks: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, channels, 3, padding=1, bias=False)
        self.norm = nn.InstanceNorm2d(channels, affine=True, track_running_stats=True)
        self.bn = nn.BatchNorm2d(channels)
        self.blocks = nn.Sequential(*[ResidualBlock(channels) for _ in range(n_blocks)])
        self.head = nn.Linear(channels, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pixels = (idx.float() / VOCAB).view(idx.shape[0], 1, 4, 4)
        x = self.blocks(F.relu(self.bn(self.norm(self.stem(pixels)))))
        return self.head(x.mean(dim=(2, 3)))  # (batch, VOCAB): one class per image


# ---- the user's random numbers (issue #30 item 7): a DiT-style denoiser whose training_step draws timesteps and ---
# ---- noise (LitLM's "_noisy" names), with dropout over replicated values inside its blocks ------------------------
class DropAdaLNBlock(AdaLNBlock):
    """adaLN block with dropout on both residual branches (replicated under tp: drawn from the user's stream)."""

    def __init__(self, dim: int, heads: int, p: float = 0.1) -> None:
        super().__init__(dim, heads)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor, c: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        shift, scale = self.modulation(c).unsqueeze(1).chunk(2, dim=-1)
        h = self.norm(x) * (1 + scale) + shift
        x = x + self.drop(self.attn(h, h, h, attn_mask=mask, need_weights=False)[0])
        return x + self.drop(self.mlp(self.norm(x) * (1 + scale) + shift))


class NoisyDiT(nn.Module):
    """Token embeddings noised at a timestep (a cosine schedule), conditioned on the timestep's sinusoidal features
    through an MLP; ``t`` and ``noise`` come from the caller (the step draws them), none at inference."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, heads: int = HEADS, n_layers: int = LAYERS) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.t_mlp = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList([DropAdaLNBlock(dim, heads) for _ in range(n_layers)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor, t: torch.Tensor | None = None, noise: torch.Tensor | None = None
                ) -> torch.Tensor:
        x = self.embed(idx)
        t = torch.zeros(idx.shape[0], device=idx.device) if t is None else t.float()
        if noise is not None:
            a = torch.cos(t / 1000 * math.pi / 2).view(-1, 1, 1)
            x = a * x + (1 - a ** 2).sqrt() * noise
        half = x.shape[-1] // 2
        freqs = torch.exp(-math.log(1e4) * torch.arange(half, device=idx.device) / half)
        c = self.t_mlp(torch.cat([torch.cos(t[:, None] * freqs), torch.sin(t[:, None] * freqs)], dim=-1))
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1], device=idx.device)
        for block in self.blocks:
            x = block(x, c, mask)
        return self.head(x)

MODELS: dict[str, Callable[[], nn.Module]] = {
    "nanogpt": NanoGPT,
    "llama": TinyLlama,
    "fused_gqa": FusedGQAModel,
    "encoder": EncoderLM,
    "seq2seq": Seq2Seq,
    "hf_gpt2": lambda: HFCausalLM("gpt2"),
    "hf_llama": lambda: HFCausalLM("llama"),
    "hf_llama_labels": lambda: HFCausalLM("llama"),
    "sequential": lambda: nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, 2 * DIM), nn.GELU(),
                                        nn.Linear(2 * DIM, DIM), nn.GELU(), nn.Linear(DIM, VOCAB)),
    "llama_varlen": TinyLlama,
    "conditioned": ConditionedLM,
    "conditioned4": lambda: ConditionedLM(n_layers=4),
    "nested_lists": NestedListLM,
    "root_param": RootParamLM,
    "hf_t5": HFT5,
    "hf_bart": HFBart,
    "hf_neox": lambda: HFCausalLMFamily("neox"),
    "hf_phi3": lambda: HFCausalLMFamily("phi3"),
    "hf_qwen2": lambda: HFCausalLMFamily("qwen2"),
    "hf_qwen3": lambda: HFCausalLMFamily("qwen3"),
    "hf_olmo2": lambda: HFCausalLMFamily("olmo2"),
    "post_norm": PostNormLM,
    "hf_gemma": lambda: HFCausalLMFamily("gemma"),
    "hf_bert": lambda: HFCausalLMFamily("bert"),
    "nanogpt4": lambda: NanoGPT(n_layer=4),
    "llama4": lambda: TinyLlama(n_layers=4),
    "flat_gpt": lambda: BlockGPT(lambda: FlatBlock(DIM, DIM // HEADS)),
    "mask_gpt": lambda: BlockGPT(lambda: MaskBlock(DIM, DIM // HEADS)),
    "split_gpt": lambda: BlockGPT(lambda: SplitBlock(DIM, HEADS)),
    "litgpt": LitGPTModel,
    "hf_vit": HFViT,
    # an MLP over the flattened sequence, as a classifier is written: pairs of Linear layers of any widths
    "mlp": lambda: nn.Sequential(nn.Embedding(VOCAB, 8), nn.Flatten(), nn.Linear(SEQ * 8, 96), nn.ReLU(),
                                 nn.Linear(96, 64), nn.ReLU(), nn.Linear(64, 96), nn.ReLU(),
                                 nn.Linear(96, SEQ * VOCAB), nn.Unflatten(1, (SEQ, VOCAB))),
    # mixtures of experts (their load-balancing loss in the model's loss)
    "hf_mixtral_labels": lambda: HFMoE("mixtral"),
    "hf_qwen2_moe_labels": lambda: HFMoE("qwen2_moe"),
    "hf_mixtral_two_experts": lambda: HFMoE("mixtral_two"),
    "hf_deepseek_v3_labels": lambda: HFMoE("deepseek_v3"),
    "hf_gpt_oss_labels": lambda: HFMoE("gpt_oss"),
    "hf_gpt_oss_one_expert": lambda: HFMoE("gpt_oss_one_expert"),
    "hf_granitemoe_labels": lambda: HFMoE("granitemoe"),
    "list_moe": ListMoELM,
    # batch statistics under micro-batching (issue #30 item 4)
    "resnet": TinyResNet,
    # the user's random numbers (issue #30 item 7)
    "dit_noisy": NoisyDiT,
}


# ---- attention with fewer K/V heads than tp ranks (issue 30): multi-query, Falcon's fused [q..., k, v] -------------
class HFFalcon(nn.Module):
    """Hugging Face Falcon-7B's layout, tiny: multi-query (one K/V head), fused ``query_key_value``, attention and MLP
    in parallel from one norm."""

    def __init__(self, new_decoder_architecture: bool = False) -> None:
        super().__init__()
        import transformers

        cfg = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=LAYERS,
                                        num_attention_heads=HEADS, multi_query=True, parallel_attn=True,
                                        new_decoder_architecture=new_decoder_architecture, num_kv_heads=1,
                                        bias=False, hidden_dropout=0.0, attention_dropout=0.0,
                                        max_position_embeddings=SEQ)
        self.model = transformers.FalconForCausalLM(cfg)
        self.model.config._attn_implementation = "eager"

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx).logits


MODELS.update({
    "mqa_llama": lambda: TinyLlama(n_kv_heads=1),  # separate q, k, v: k and v one head each
    "mqa_fused": lambda: FusedGQAModel(n_kv_head=1),  # fused [q | k | v], split by sizes
    "gqa8_kv2": lambda: TinyLlama(dim=64, n_heads=8, n_kv_heads=2),  # kv < tp=4 with two K/V heads (Llama-3-70B's case)
    "hf_falcon": HFFalcon,
    "hf_falcon_new": lambda: HFFalcon(new_decoder_architecture=True),  # per-group [q_g..., k_g, v_g]
    "hf_llama_mqa": lambda: HFCausalLM("llama", kv_heads=1),  # num_key_value_groups read by repeat_kv
})


# ---- norms over every head's features inside the attention (OLMo-2's q_norm / k_norm, written by hand) ----------
class WideNormAttention(nn.Module):
    """Its own pre-norm of the block's input (whole hidden: its gradient whole on every tp rank) and LayerNorms over
    the whole query and key projections (all heads at once: each rank's columns need the others')."""

    def __init__(self, dim: int = DIM, heads: int = HEADS) -> None:
        super().__init__()
        self.pre = nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.q_norm, self.k_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.pre(x)
        q, k, v = self.q_norm(self.q(h)), self.k_norm(self.k(h)), self.v(h)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class WideNormLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(PreNormResidual(DIM, WideNormAttention()) for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


MODELS["wide_qk_norm"] = WideNormLM


# ---- a DiT-style diffusion transformer (issue 30): adaLN-Zero blocks read a conditioning vector -----------------
def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class DiTBlock(nn.Module):
    """DiT's block with its projections as its own children: fused qkv, a plain MLP, and the adaLN-Zero modulation
    ``Sequential(SiLU, Linear(d, 6 d))`` of the conditioning vector ``c`` (shift / scale / gate for each half)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.num_heads = heads
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.fc1, self.act, self.fc2 = nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        B, N, C = x.shape
        h = _modulate(self.norm1(x), shift_msa, scale_msa)
        q, k, v = self.qkv(h).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C)
        x = x + gate_msa.unsqueeze(1) * self.proj(a)
        h = _modulate(self.norm2(x), shift_mlp, scale_mlp)
        return x + gate_mlp.unsqueeze(1) * self.fc2(self.act(self.fc1(h)))


class TinyDiT(nn.Module):
    """Patchify linear, sinusoidal timestep + MLP, a 16-row label embedding, adaLN-Zero blocks, a modulated final
    layer (2 x 2 patches of 4 latent channels: 16 outputs, as many as the label rows). ``forward(idx)`` is the
    training objective (noise prediction, MSE), all from the token ids: the latent is the first 16 ids as a 4 x 4
    picture in 4 channels, the timestep and label come from the ids, the noise is a fixed pattern."""

    def __init__(self, dim: int = DIM, heads: int = HEADS, depth: int = LAYERS, classes: int = 15) -> None:
        super().__init__()
        self.patch, self.freq = 2, 32
        self.x_embedder = nn.Linear(self.patch * self.patch * 4, dim)
        self.t_embedder = nn.Sequential(nn.Linear(self.freq, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.y_embedder = nn.Embedding(classes + 1, dim)  # + the "no label" row of classifier-free guidance
        self.register_buffer("pos_embed", torch.sin(torch.arange(4 * dim).float().view(4, dim) / 7.0))
        self.blocks = nn.ModuleList([DiTBlock(dim, heads) for _ in range(depth)])
        self.norm_final = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.final_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.final = nn.Linear(dim, self.patch * self.patch * 4)
        self.classes = classes

    def timestep_embedding(self, t: torch.Tensor) -> torch.Tensor:
        half = self.freq // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B = idx.shape[0]
        image = (idx[:, :16].float().view(B, 1, 4, 4) / VOCAB * 2 - 1) * torch.tensor([1.0, -0.5, 0.25, 2.0],
                                                                                      device=idx.device).view(4, 1, 1)
        t = idx[:, 0] * 15 % 1000
        labels = idx[:, 1] % (self.classes + 1)
        noise = torch.sin(torch.arange(64.0, device=idx.device).view(1, 4, 4, 4) * (1 + t.view(B, 1, 1, 1) / 100))
        alpha = torch.cos(t.float() / 1000 * math.pi / 2).view(B, 1, 1, 1)
        noisy = alpha * image + (1 - alpha ** 2).sqrt() * noise
        patches = patches_of(noisy)  # (B, 4 patches, 2 x 2 pixels x 4 channels)
        x = self.x_embedder(patches) + self.pos_embed
        c = self.t_embedder(self.timestep_embedding(t)) + self.y_embedder(labels)
        for block in self.blocks:
            x = block(x, c)
        shift, scale = self.final_modulation(c).chunk(2, dim=1)
        out = self.final(_modulate(self.norm_final(x), shift, scale))
        return F.mse_loss(out, patches_of(noise))


def patches_of(image: torch.Tensor) -> torch.Tensor:
    """(B, 4, 4, 4) -> (B, 4 patches, 16): each 2 x 2 patch's pixels of every channel."""
    return image.unfold(2, 2, 2).unfold(3, 2, 2).permute(0, 2, 3, 1, 4, 5).reshape(image.shape[0], 4, 16)


MODELS["dit"] = TinyDiT


class LitLM(L.LightningModule):
    """An ordinary next-token LightningModule around any model above."""

    def __init__(self, name: str = "nanogpt", lr: float = 0.1, optimizer: str = "sgd",
                 build_in_configure_model: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = None if build_in_configure_model else MODELS[name]()

    def configure_model(self) -> None:  # Lightning's hook for large models (the strategy builds it on meta)
        if self.model is None:
            self.model = MODELS[self.hparams.name]()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.hparams.name.endswith("_varlen"):  # a new sequence length every other step
            x, y = x[:, :SEQ - 4 * (batch_idx % 2)], y[:, :SEQ - 4 * (batch_idx % 2)]
        if self.hparams.name.endswith("_labels"):  # the Hugging Face model computes the loss in its forward
            loss = self.model.model(input_ids=x, labels=x).loss
        elif self.hparams.name.endswith("_noisy"):  # a diffusion model's draws, in the step, from the global stream
            t = torch.randint(0, 1000, (x.shape[0],), device=x.device)
            noise = torch.randn(*x.shape, self.model.embed.embedding_dim, device=x.device)
            loss = F.cross_entropy(self.model(x, t=t, noise=noise).reshape(-1, VOCAB), y.reshape(-1))
        else:
            out = self(x)  # a classifier (the vision transformer) predicts the first target of each sequence
            out, aux = out if isinstance(out, tuple) else (out, 0.0)  # a model that returns its auxiliary loss
            if out.dim() == 0:  # the model computes its own objective (the diffusion transformer)
                loss = out
            elif out.dim() == 2:
                loss = F.cross_entropy(out, y[:, 0])
            else:
                loss = F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))
            loss = loss + 0.02 * aux
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        out = self(x)  # a model that computes its own loss returns it (0-dim)
        self.log("val_loss", out if out.dim() == 0 else F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1)),
                 sync_dist=True)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        if self.hparams.optimizer == "sgdm":  # momentum: optimizer state, linear in the gradients
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        if self.hparams.optimizer == "adafactor":  # factored state: row/column statistics, not shaped like weights
            return torch.optim.Adafactor(self.parameters(), lr=self.hparams.lr)
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def token_dataset(n: int = 64, seq: int = SEQ, seed: int = 0) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (n, seq + 1), generator=g)
    return torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:])


# ---- plain nn.Sequential stacks of mixed layers held inside a module (issue #30 item 5) --------------------------
class SeqInModule(nn.Module):
    """A per-token MLP of mixed layers held as ``self.net`` beside a small output norm; the forward calls it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, 2 * DIM), nn.ReLU(), nn.LayerNorm(2 * DIM),
                                 nn.Linear(2 * DIM, DIM), nn.GELU(), nn.Linear(DIM, VOCAB))
        self.norm = nn.LayerNorm(VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.norm(self.net(idx))


class SeqEncoder(nn.Module):
    """An encoder (not a Sequential) holding ``layers``, a Sequential of different classes, and a final norm."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.layers = nn.Sequential(PreNormResidual(dim, nn.Linear(dim, dim)), nn.Linear(dim, 2 * dim), nn.GELU(),
                                    nn.Linear(2 * dim, dim), nn.LayerNorm(dim),
                                    PreNormResidual(dim, nn.Sequential(nn.Linear(dim, dim), nn.Tanh())))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.layers(x))


class SeqNestedLM(nn.Module):
    """Embedding, the encoder above, head: the Sequential sits at ``encoder.layers`` with most of the parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.encoder = SeqEncoder()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(idx)))


MODELS.update({"seq_in_module": SeqInModule, "seq_nested": SeqNestedLM})


# ---- losses averaged over a varying number of tokens (issue #44 item 1) -------------------------------------------
def _lengths(idx: torch.Tensor) -> torch.Tensor:
    """Each sample's length before its padding: SEQ // 2 .. SEQ, read from its first token."""
    return SEQ - idx[:, 0] % (SEQ // 2 + 1)


class HFTokenLoss(nn.Module):
    """Hugging Face models computing their own ``.loss`` on padded batches whose labels are -100 where nothing is
    predicted, each sample counting a different number of tokens (as a collator hands them over):

    - ``"mlm"``: ModernBERT's masked LM: labels only at masked positions (about a quarter), padding masked out;
    - ``"sft"``: a Llama causal LM fine-tuned on answers: the prompt (1-4 tokens) and the padding are -100;
    - ``"s2s"``: BART, an encoder-decoder whose padded decoder labels are -100.
    """

    def __init__(self, kind: str) -> None:
        super().__init__()
        import transformers

        self.kind = kind
        if kind == "mlm":
            cfg = transformers.ModernBertConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM,
                                                num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                                max_position_embeddings=SEQ, pad_token_id=0, mask_token_id=VOCAB - 1,
                                                bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
                                                global_attn_every_n_layers=2, local_attention=8,
                                                embedding_dropout=0.0, mlp_dropout=0.0, attention_dropout=0.0)
            cfg._attn_implementation = "sdpa"
            self.model = transformers.ModernBertForMaskedLM(cfg)
        elif kind == "sft":
            cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM,
                                           num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=2,
                                           max_position_embeddings=SEQ, tie_word_embeddings=False)
            cfg._attn_implementation = "sdpa"
            self.model = transformers.LlamaForCausalLM(cfg)
        else:
            cfg = transformers.BartConfig(vocab_size=VOCAB, d_model=DIM, encoder_layers=LAYERS, decoder_layers=LAYERS,
                                          encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
                                          encoder_ffn_dim=2 * DIM, decoder_ffn_dim=2 * DIM,
                                          max_position_embeddings=SEQ, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                          decoder_start_token_id=2, forced_eos_token_id=None,
                                          dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
            self.model = transformers.BartForConditionalGeneration(cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        mask = (positions < _lengths(idx)[:, None]).long()
        ids = idx.masked_fill(mask == 0, 0)
        if self.kind == "mlm":
            masked = ((idx * 7 + positions) % 4 == 0) & (mask == 1)
            labels = ids.masked_fill(~masked, -100)
            return self.model(input_ids=ids.masked_fill(masked, VOCAB - 1), attention_mask=mask, labels=labels).loss
        if self.kind == "sft":
            prompt = positions < (1 + idx[:, 1] % 4)[:, None]
            labels = ids.masked_fill(prompt | (mask == 0), -100)
            return self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        labels = ids.flip(1).masked_fill(mask == 0, -100)  # a target of its own length, padded
        return self.model(input_ids=ids, attention_mask=mask, labels=labels).loss


MODELS.update({"hf_mlm_tokens": lambda: HFTokenLoss("mlm"), "hf_sft_tokens": lambda: HFTokenLoss("sft"),
               "hf_s2s_tokens": lambda: HFTokenLoss("s2s")})


# ---- a parent reading its child's weight functionally (issue #44 item 3) ------------------------------------------
class MambaMixer(nn.Module):
    """Jamba's Mamba mixer, tiny: its depthwise convolution's weight is read with ``F.conv1d(x, self.conv1d.weight,
    ...)`` and its output projection's with ``F.linear``; neither ``self.conv1d`` nor ``self.out_proj`` is called."""

    def __init__(self, dim: int = DIM, kernel: int = 4) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, 2 * dim)
        self.conv1d = nn.Conv1d(dim, dim, kernel, groups=dim, padding=kernel - 1)
        self.out_proj = nn.Linear(dim, dim)
        self.D = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        h, gate = self.in_proj(x).chunk(2, dim=-1)
        h = F.conv1d(h.transpose(1, 2), self.conv1d.weight, self.conv1d.bias, padding=self.conv1d.padding[0],
                     groups=h.shape[-1])[..., :T].transpose(1, 2)
        h = F.silu(h) + h * self.D
        return F.linear(h * F.silu(gate), self.out_proj.weight, self.out_proj.bias)


class MambaLayer(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mixer = MambaMixer(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mixer(self.norm(x))


class AttentionLayer(nn.Module):
    def __init__(self, dim: int = DIM, heads: int = HEADS) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        return x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]


class JambaLM(nn.Module):
    """A Mamba layer and an attention layer as Jamba has them, held as attributes (no repeated block sequence: each
    module holding parameters is FSDP2's unit of its own), the head read with ``F.linear(h, self.lm_head.weight)``.
    ``nn.MultiheadAttention`` itself reads its ``out_proj``'s weight without calling it. ``blocks``: the attention
    layers repeated in a list (FSDP2's blocks), the Mamba layer a stem before them and the head a vocabulary matrix
    (computed over dp where it is called), both read outside their modules. ``aux``: the head also called, on the
    Mamba layer's output (an auxiliary prediction added to the logits)."""

    def __init__(self, blocks: bool = False, aux: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mamba = MambaLayer()
        if blocks:
            self.layers = nn.ModuleList(AttentionLayer() for _ in range(LAYERS))
        else:
            self.attention = AttentionLayer()
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.aux = aux

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.mamba(self.embed(idx))
        aux = self.lm_head(x) if self.aux else 0.0
        for layer in self.layers if hasattr(self, "layers") else [self.attention]:
            x = layer(x)
        return F.linear(self.norm(x), self.lm_head.weight) + 0.5 * aux


class OpaqueJambaLM(JambaLM):
    """``JambaLM`` whose forward looks at a token id's value (a meta copy cannot run it: the reads are found in the
    first step instead)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if bool((idx < 0).any()):
            raise ValueError("token ids must not be negative")
        return super().forward(idx)


MODELS.update({"functional_reads": JambaLM, "functional_reads_blocks": lambda: JambaLM(blocks=True),
               "functional_reads_aux": lambda: JambaLM(aux=True), "functional_reads_opaque": OpaqueJambaLM,
               "functional_reads_aux_opaque": lambda: OpaqueJambaLM(aux=True)})
