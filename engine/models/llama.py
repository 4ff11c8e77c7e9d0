"""Llama 2/3 and Mistral (and the blocks Qwen2/Qwen3 reuse): pre-norm decoder layers of
GQA attention with RoPE and a SwiGLU MLP."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.runner.attention.metadata import ForwardContext
from engine.layers.activation import SiluAndMul
from engine.executor.distributed import tp_size
from engine.layers.attention import Attention
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.params import default_dtype
from engine.layers.rotary import RotaryEmbedding
from engine.models.shape import ModelShape


# NOTE: the most tokens a step may have for its layers to take the small-batch kernels (decode
# batches of 1-8): past it the weight is no longer what a step's matmuls mostly read
SMALL_BATCH_ROWS = 8


# NOTE: which FP8 products leave their scales to the kernel that reads them next (an
# ``UnscaledProduct``; engine/layers/fp8.py). o and down, read by an RMSNorm: batch-1 decode
# 4.46 against 4.52 ms a token and 407 launches a step against 471, twice alternating on an H100
# (2026-12-06, scripts/gpu_small_batch_ab.sh stage fp8defer). Not gate/up: SiLU-mul's float8
# kernel runs one program per row, and there the fp32 product and its 28,672 scales cost more
# than the launch saved (all three: 4.64 ms).
DEFERRED_SCALES: tuple[str, ...] = ("o_proj", "down_proj")
# NOTE: which full-precision projections take ``small_m_linear`` (one launch, split-K merged
# in-kernel) at up to SMALL_BATCH_ROWS tokens, where the five-kernel layer is off. o and down:
# batch-1 bf16 decode 5.94 against 6.01 ms a token and 279 launches a step against 343 (cuBLAS
# ran each as split-K plus a reduce), on an H100 (2026-12-06, scripts/gpu_small_batch_ab.sh stage
# smallm). Not qkv and gate/up: there cuBLAS read faster (session 27's probe).
SMALL_M_PROJECTIONS: tuple[str, ...] = ("o_proj", "down_proj")
# NOTE: what runs inside o's and down's small_m_linear launches, where they take it: "silu_in",
# SiLU-mul in down's prologue (any rank count); "norm_after", the RMSNorm after each (the
# post-attention norm after o; the next layer's input norm or the final norm after down), on one
# rank (the norm needs the whole sum). Both: five kernels a layer with cuBLAS's q/k/v and gate/up
# kept (174 a batch-1 step against 270). Measured on an H100, bf16 batch 1 (2026-12-06,
# scripts/gpu_small_batch_ab.sh stage folds): none 6.18-6.19 ms a token; silu_in 7.18 (down's
# kernel time +1.06 ms a step: every program computes SiLU over the 16-row dot tile, 15 rows of
# them padding, for its slice of K); both 7.16 (a 4,096-wide row at once) or 7.23 (1,024-wide
# chunks). So off. Since then a one-row product computes SiLU for its row alone (ONE_ROW in
# sluiceway_kernels/small_m_linear.py). Measured again on an H100 in one call (2026-12-07, stage
# folds, one run each): none 5.81 ms a token (279 launches a step), silu_in 5.85 (247), norm_after
# 5.88 (215), both 5.91 (183; the five-kernel layer of --small-batch-kernels took 6.85 on another
# H100 that day). The folded work costs inside the launch what it cost outside (o's and down's
# kernel +0.19 ms a step, the norms' and SiLU-mul's kernels -0.20 ms): still off, the fastest.
SMALL_M_FOLDS: tuple[str, ...] = ()
# NOTE: the same for FP8 layers: at up to SMALL_BATCH_ROWS tokens o and down are our float8
# split-K product (sluiceway_kernels/fp8_small_m.py) with the norm after each, and its per-token
# quantization for the next FP8 product, in their launch (SiLU-mul stays the kernel that
# quantizes down's input). On an H100, batch-1 FP8 decode (2026-12-06, stage fp8folds, one pair):
# 4.45 against 4.46 ms a token, 311 launches a step against 407. Off: no faster there, and its
# engine path's GPU tests (tests/engine/test_fp8_gpu.py, folds=True) have not run yet.
FP8_SMALL_M_FOLDS = False
# NOTE: which FP8 projections take our float8 split-K product (sluiceway_kernels/fp8_small_m.py:
# both scales applied in its launch, so no scale epilogue follows and nothing is left unscaled;
# o's float input quantized in the launch too, so no quantization kernel comes before it)
# rather than cuBLASLt's at up to SMALL_BATCH_ROWS tokens, with or without FP8_SMALL_M_FOLDS. All
# four at up to 16 tokens (engine.layers.fp8.TRITON_ROWS) measured 3% slower at batch 1 on an H100
# (session 28). One at a time (stage fp8proj of scripts/gpu_small_batch_ab.sh, H100, session 35,
# two runs each, -q fp8 --kv-cache-dtype fp8): q/k/v alone 3.93 / 3.93 ms a token against 4.02 /
# 4.00 with none (375 launches against 407); q/k/v with o, or o with down, 6.69-6.70 ms.
FP8_SMALL_M_PROJECTIONS: tuple[str, ...] = ("qkv_proj",)


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, rotary: RotaryEmbedding,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool, quantization: str | None = None):
        super().__init__()
        shape = ModelShape.from_hf_config(config)
        head_dim = shape.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          shape.num_kv_heads, bias=qkv_bias, quantization=quantization)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=o_bias,
                                        quantization=quantization)
        self.rotary_emb = rotary
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, head_dim, scale=head_dim**-0.5)
        # Qwen3 normalises each head of q and k before RoPE.
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(T, H) -> q (T, Hq*D), k and v (T, Hkv*D), not yet rotated."""
        return self.split_qkv(self.qkv_proj(hidden))

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projection's (T, (Hq+2Hkv)*D) -> q, k, v (Qwen3: q and k normed per head)."""
        num_tokens = qkv.shape[0]
        q, k, v = self.qkv_proj.split(qkv)  # (T, Hq*D), (T, Hkv*D), (T, Hkv*D)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(num_tokens, -1)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(num_tokens, -1)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               ctx: ForwardContext, out: torch.Tensor | None = None) -> torch.Tensor:
        """The backend rotates q and k (inside the decode kernel on a decode step), stores k and
        v and attends: (T, Hq*D), into ``out`` when given."""
        return self.attn(q, k, v, ctx, positions, self.rotary_emb.cos_sin_cache, out)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.o_proj(self.attend(*self.project(hidden), positions, ctx))  # (T, H)


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, quantization: str | None = None):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu'")
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=bias,
                                                       quantization=quantization)
        # NOTE: at TP > 1 the down projection's input scales are a max over the ranks, so
        # the activation is quantized there, not here
        self.act = SiluAndMul(quantize=quantization == "fp8" and tp_size() == 1)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias,
                                           quantization=quantization)
        # SiLU-mul in the down projection's launch where it takes small_m_linear (SMALL_M_FOLDS)
        self.silu_in = "silu_in" in SMALL_M_FOLDS and self.down_proj.folds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2I/tp)
        if self.silu_in and self.down_proj.takes_small_m(gate_up):
            return self.down_proj.small_forward(gate_up, silu_in=True)
        return self.down_proj(self.act(gate_up))  # (T, 2I/tp) -> (T, I/tp) -> (T, H)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, rotary: RotaryEmbedding, quantization: str | None = None,
                 **attention_options: bool):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, rotary, quantization=quantization, **attention_options)
        self.mlp = LlamaMLP(config, quantization)
        fp8 = quantization == "fp8"  # the norms feed FP8 projections: they quantize their outputs
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, quantize=fp8)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, quantize=fp8)
        self.projections = {"qkv_proj": self.self_attn.qkv_proj, "o_proj": self.self_attn.o_proj,
                            "gate_up_proj": self.mlp.gate_up_proj, "down_proj": self.mlp.down_proj}
        for name, linear in self.projections.items():
            # NOTE: only a product an RMSNorm (o; down: the next layer's or the final norm) or SiLU-mul
            # (gate/up) reads next may leave its scales to it: never qkv, read by rotary attention
            linear.defer_scales = fp8 and name in DEFERRED_SCALES and name != "qkv_proj"
            linear.fp8_small_m = fp8 and name in FP8_SMALL_M_PROJECTIONS
            linear.small_m_rows = SMALL_BATCH_ROWS if name in SMALL_M_PROJECTIONS or linear.fp8_small_m else 0
        self.small_batch_kernels = False  # see use_small_batch_kernels
        self.folds_norms = False  # see fold_norm_after
        self.next_norm: tuple[RMSNorm, ...] = ()

    def fold_norm_after(self, norm: RMSNorm, on: bool) -> None:
        """``norm`` (the next layer's input norm, or the model's final one) runs inside the down
        projection's launch where it takes small_m_linear, and the post-attention norm inside
        o's (``SMALL_M_FOLDS``'s "norm_after"); the model turns it on for every layer or none."""
        # NOTE: a tuple, so that nn.Module does not register the norm here: it belongs to the
        # next layer (or the model), and a second name for its weight would confuse the loader
        self.next_norm = (norm,)
        self.folds_norms = on

    def can_fold_norms(self) -> bool:
        """Whether o and down can take the norms after them: no bias, one rank, full precision
        (SMALL_M_FOLDS's "norm_after") or float8 (FP8_SMALL_M_FOLDS)."""
        o, down = self.self_attn.o_proj, self.mlp.down_proj
        fp8 = o.weight_scale is not None
        wanted = FP8_SMALL_M_FOLDS if fp8 else "norm_after" in SMALL_M_FOLDS
        return (wanted and tp_size() == 1 and o.small_m_rows > 0 and down.small_m_rows > 0
                and all(linear.bias is None for linear in (o, down)))

    def norms_folded(self, x: torch.Tensor) -> bool:
        """Whether this step's norms run inside o's and down's launches (the same answer in every
        layer of a step: it depends on the token count alone)."""
        return (self.folds_norms and not self._small(x) and self.self_attn.o_proj.takes_small_m(x)
                and self.mlp.down_proj.takes_small_m(x))

    def use_small_batch_kernels(self, on: bool) -> bool:
        """Steps of up to SMALL_BATCH_ROWS tokens run this layer in five kernels (q/k/v with the
        input norm folded in, attention, the output projection, gate/up with the norm and
        SwiGLU folded in, down: ``sluiceway_kernels/small_m_linear.py``) where every projection
        can fold (full-precision weights, no biases). Returns whether the layer does."""
        self.small_batch_kernels = on and all(linear.folds for linear in self.projections.values())
        return self.small_batch_kernels

    def _small(self, x: torch.Tensor) -> bool:
        return self.small_batch_kernels and x.shape[0] <= SMALL_BATCH_ROWS

    def _folded_post_attention(self, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """o with the post-attention norm in its launch, gate/up, down with SiLU-mul (full
        precision) and the next norm in its launch. An FP8 layer's norms quantize their output
        for the FP8 product that reads it, and its SiLU-mul stays the kernel that quantizes."""
        norm, after, mlp = self.post_attention_layernorm, self.next_norm[0], self.mlp
        fp8 = {"quantize": norm.quantize} if mlp.down_proj.weight_scale is not None else {}
        hidden, residual = self.self_attn.o_proj.small_forward(
            attn_out, norm_after=norm.weight, eps=norm.eps, residual=residual, **fp8)
        gate_up = mlp.gate_up_proj(hidden)
        if fp8:
            return mlp.down_proj.small_forward(mlp.act(gate_up), norm_after=after.weight, eps=after.eps,
                                               residual=residual, quantize=after.quantize)
        act = {"silu_in": True} if mlp.silu_in else {}
        return mlp.down_proj.small_forward(gate_up if act else mlp.act(gate_up), norm_after=after.weight,
                                           eps=after.eps, residual=residual, **act)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        *qkv, residual = self.pre_attention(hidden, residual)
        return self.post_attention(self.self_attn.attend(*qkv, positions, ctx), residual)

    # NOTE: the halves either side of attention, which reads the step's metadata: prompt-carrying
    # steps replay them as captured graphs and launch only attention (engine/runner/prefill_graphs.py)
    def pre_attention(
        self, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(T, H) and the residual (None before the first layer) -> q, k, v, the new residual."""
        if self._small(hidden):
            norm, attn = self.input_layernorm, self.self_attn
            folded = attn.qkv_proj.small_forward(hidden, norm_weight=norm.weight, eps=norm.eps, residual=residual)
            qkv, residual = (folded, hidden) if residual is None else folded  # the first layer: no sum yet
            return (*attn.split_qkv(qkv), residual)
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden  # (T, H) each
        elif not self.norms_folded(hidden):  # folded: the previous layer's down launch normalised it
            hidden, residual = self.input_layernorm(hidden, residual)
        return (*self.self_attn.project(hidden), residual)

    def post_attention(self, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention's (T, Hq*D) and the residual -> the layer's output and the new residual."""
        if self._small(attn_out):
            norm = self.post_attention_layernorm
            act, residual = self.mlp.gate_up_proj.small_forward(
                self.self_attn.o_proj.small_forward(attn_out), norm_weight=norm.weight, eps=norm.eps,
                residual=residual, silu_mul=True)  # (T, I/tp)
            return self.mlp.down_proj.small_forward(act), residual
        if self.norms_folded(attn_out):  # the output is the next norm's, already applied (fold_norm_after)
            return self._folded_post_attention(attn_out, residual)
        hidden, residual = self.post_attention_layernorm(self.self_attn.o_proj(attn_out), residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, quantization: str | None = None, **attention_options: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding.from_config(config, ModelShape.from_hf_config(config).head_dim)  # shared by the layers
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary, quantization, **attention_options) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        folds = all(layer.can_fold_norms() for layer in self.layers)
        for layer, norm in zip(self.layers, [*(layer.input_layernorm for layer in self.layers[1:]), self.norm]):
            layer.fold_norm_after(norm, folds)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # (T, H)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, ctx)
        return self.final_norm(hidden, residual)  # (T, H)

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer's output and residual -> the normalised hidden state (already so where
        the last down projection's launch applied the norm)."""
        if self.layers[-1].norms_folded(hidden):
            return hidden
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids (T,), positions (T,), ctx) -> hidden (T, H)`` over a flattened
    varlen batch; ``compute_logits(hidden (N, H)) -> (N, vocab)`` float32."""

    # checkpoint module name -> (our fused module, shard id passed to its weight_loader)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # checkpoint tensors with no parameter here (precomputed RoPE tables of old exports)
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, quantization: str | None = None):
        super().__init__()
        self.config = config
        # the decoder layers' linear layers are quantized; embedding, norms and LM head are not
        with default_dtype(dtype):
            self.model = LlamaModel(config, quantization, **self.attention_options(config))
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)

    @staticmethod
    def attention_options(config: Any) -> dict[str, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return dict(qkv_bias=bias, o_bias=bias, qk_norm=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)  # (T, H)

    def use_small_batch_kernels(self, on: bool = True) -> int:
        """Fold the norms and SwiGLU into the projections at steps of up to SMALL_BATCH_ROWS
        tokens (``LlamaDecoderLayer.use_small_batch_kernels``); returns how many layers do."""
        return sum(layer.use_small_batch_kernels(on) for layer in self.model.layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # (N, vocab)
