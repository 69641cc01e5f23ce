"""A lean forward for Llama-family targets (Llama, Qwen2, Qwen3, Mistral), in plain PyTorch.

On a CPU a small model's decode step is mostly framework overhead: the HF forward builds 4-D masks, walks
generic attention dispatch and keyword plumbing in each of its layers. This path does per layer only the
arithmetic: one fused q/k/v matmul, RoPE, a write into the same slot-indexed static cache (transformers'
StaticLayer, so every cache operation of TargetAdapter applies unchanged), SDPA, one fused gate/up matmul.
The weights are the HF model's own (q/k/v and gate/up concatenated once); the hidden-state taps the draft
needs are read as the layers go.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from .errors import DFlashConfigError
from .kernels import Int4Weight, Int8Weight, PackedWeight, cache_attention_kernel, int4_kernel, int8_weight, packable
from .compiled import compile_frozen
from .rope import rope_tables
from .target import TargetAdapter, decoder_layers

FAST_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
log = logging.getLogger("dflash")


def fast_unsupported(model) -> str | None:
    """Why the lean path cannot run this model (None when it can)."""
    cfg = model.config.get_text_config()
    if cfg.model_type not in FAST_MODEL_TYPES:
        return f"model type {cfg.model_type!r} (the fast runtime covers {', '.join(FAST_MODEL_TYPES)})"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) and \
            cfg.sliding_window < cfg.max_position_embeddings:
        return f"sliding-window attention ({cfg.sliding_window})"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    layers = decoder_layers(model)
    if getattr(layers[0].mlp, "gate_proj", None) is None:
        return "an MLP without gate_proj/up_proj"
    return None


QUANTIZED = {"int8": Int8Weight, "int4": Int4Weight}
PROMPT_DENSE_ROWS = 16  # prompt tokens from which a prompt pass multiplies by the model's own weights, see dense_rows
CACHE_KERNEL_QUERIES = 16  # prompt passes of up to this many tokens attend through dflash's kernel on the CPU


def _prepared(w: torch.Tensor, quantize: str | None):
    """A weight in the form the fast forward multiplies by: quantised, prepacked for oneDNN, or as it is."""
    if quantize is not None:
        return QUANTIZED[quantize](w)
    return PackedWeight(w) if packable(w) else w.detach()


def _linear(x: torch.Tensor, w, b=None) -> torch.Tensor:
    return F.linear(x, w, b) if isinstance(w, torch.Tensor) else w.linear(x, b)


def _dense_linear(x: torch.Tensor, parts: tuple[nn.Linear, ...], upcast: bool) -> torch.Tensor:
    """x times the model's own weights of `parts` (a fused product's HF layers, outputs concatenated), in fp32
    where `upcast`, rounded back to x's dtype: a long prompt pass, see FastForward.dense_rows."""
    xs = x.float() if upcast else x
    ys = [F.linear(xs, m.weight.float() if upcast else m.weight,
                   None if m.bias is None else (m.bias.float() if upcast else m.bias)) for m in parts]
    return (ys[0] if len(ys) == 1 else torch.cat(ys, -1)).to(x.dtype)


def _fused(modules: tuple[nn.Linear, ...], quantize: str | None):
    """The weights of `modules` concatenated (one product for all of them), in the form the fast forward
    multiplies by. Where that form is the plain tensor (fp32, or a GPU), the modules' own weights become views
    of it: one copy of the weights in memory, not two (an 8B model would otherwise hold 9 GB more)."""
    with torch.inference_mode(False):  # ordinary tensors, even when built inside an inference-mode region
        fused = torch.cat([m.weight for m in modules]).detach()
    prepared = _prepared(fused, quantize)
    if isinstance(prepared, torch.Tensor):  # multiplied as it is
        start = 0
        for m in modules:
            rows = m.weight.shape[0]
            m.weight = nn.Parameter(prepared[start:start + rows], requires_grad=False)
            start += rows
    return prepared


def _fused_bias(modules: tuple[nn.Linear, ...]):
    return torch.cat([m.bias for m in modules]).detach() if modules[0].bias is not None else None


class _Layer:
    def __init__(self, layer, quantize: str | None):
        a, m = layer.self_attn, layer.mlp
        qkv, gu = (a.q_proj, a.k_proj, a.v_proj), (m.gate_proj, m.up_proj)
        self.wqkv, self.bqkv = _fused(qkv, quantize), _fused_bias(qkv)
        self.wo, self.bo = _prepared(a.o_proj.weight, quantize), a.o_proj.bias
        self.q_norm = getattr(a, "q_norm", None)
        self.k_norm = getattr(a, "k_norm", None)
        self.ln1, self.ln2 = layer.input_layernorm, layer.post_attention_layernorm
        self.wgu, self.bgu = _fused(gu, quantize), _fused_bias(gu)
        self.wdown, self.bdown = _prepared(m.down_proj.weight, quantize), m.down_proj.bias
        # the same products by the HF layers' own weights, for long prompt passes (FastForward.dense_rows)
        self.parts = (qkv, (a.o_proj,), gu, (m.down_proj,))


def _eps(module: nn.Module) -> float:
    return getattr(module, "variance_epsilon", None) or getattr(module, "eps", 1e-6)


def _norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # as HF's RMSNorm: statistics in fp32, the weight applied in the input's dtype
    return module.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=_eps(module)).to(x.dtype)


def _weight(module: nn.Module | None) -> torch.Tensor | None:
    return None if module is None else module.weight


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _kernel_norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # the same arithmetic in one op (kernels.cache_attention_kernel's library): PyTorch's takes five ops and tens
    # of microseconds for a step's few bf16 rows
    return torch.ops.dflash_attn.rms_norm(x, module.weight, _eps(module))


class FastForward:
    """The lean forward of one HF model (built once per model, see `fast_forward`)."""

    def __init__(self, model, quantize: str | None = None):
        reason = fast_unsupported(model)
        if reason is not None:
            raise DFlashConfigError(f"the fast runtime does not support {reason}; use runtime='hf'")
        cfg = model.config.get_text_config()
        self.model = model
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        self.gqa = self.num_kv_heads != self.num_heads
        self.embed = model.get_input_embeddings()
        head = model.get_output_embeddings()
        # a 4-bit model keeps its output layer at 8 bits, as 4-bit GGUF files store it (Q8_0 or Q6_K): the logits
        # decide every token. Q8_0's groups of 32 on dflash's kernel where it runs, else int8 per row
        self.head_weight = int8_weight(head.weight) if quantize == "int4" else _prepared(head.weight, quantize)
        self.head_bias = getattr(head, "bias", None)
        inner = model.get_decoder()
        self.rotary = inner.rotary_emb
        self.final_norm = inner.norm
        self.layers = [_Layer(layer, quantize) for layer in decoder_layers(model)]
        dtype = next(model.parameters()).dtype
        on_cpu = next(model.parameters()).device.type == "cpu"
        # On the CPU, decode and verify steps (and short prompt passes) attend through dflash's kernel
        # (kernels.cache_attention_kernel): it reads the cache in the model's dtype and computes every query the
        # same way whatever else is in the step. Without it, PyTorch's bf16/fp16 attention for a few queries over a
        # long cache is several times slower than fp32, so the cache then holds fp32.
        self.cache_kernel = on_cpu and self.head_dim % 16 == 0 and cache_attention_kernel()
        # on a GPU, SDPA with an explicit mask and enable_gqa falls back to its unfused math kernel (all scores in
        # memory: ~34 GB a layer for a 16k-token prompt of an 8B model); with the key/value heads expanded to the
        # query heads it runs the fused memory-efficient kernel
        self.expand_kv = not on_cpu and self.gqa
        self.norm = _kernel_norm if (on_cpu and dtype == torch.bfloat16 and cfg.hidden_size % 16 == 0 and
                                     self.head_dim % 16 == 0 and cache_attention_kernel()) else _norm
        # with the norm op, SiLU(gate) * up is the library's op too: the arithmetic decoder_layers does
        self.silu_mul = torch.ops.dflash_attn.silu_mul if self.norm is _kernel_norm else _silu_mul
        self.attn_dtype = dtype if (self.cache_kernel or not on_cpu) else torch.float32
        # Kernels made for the few rows of a step can be slow for a prompt's hundreds. Where the CPU has no
        # bf16/fp16 matmul kernels (AVX2-only: oneDNN will not pack the weights), PyTorch's fallback costs about
        # linearly in the rows, several times an fp32 product; the weight-only int8/int4 kernels are
        # compute-bound on many rows too (twice the time of the bf16 prompt pass on an AVX-512 CPU). A prompt
        # pass of `dense_rows` tokens or more then multiplies by the HF layers' own weights, in fp32 (widened
        # on the fly: exactly; only the summation order differs) where the CPU has no half kernels, and rounds
        # back. Only the prompt pass: every later step, decode or verify, keeps the runtime's own kernels, so
        # plain and speculative decoding still share every product after the prompt, and the prompt pass
        # itself. (A quantised target's prompt is thereby read by the weights it was quantised from.)
        # The exception: without half kernels, dflash's own int4 kernel reads a prompt faster than fp32 products
        # do (time to first token of `dflash bench --methods ar` on GSM8K and MBPP prompts, AVX2-only EPYC:
        # 1.4-1.8x lower), so an int4 target whose every product runs on it keeps it for prompt passes too.
        half = on_cpu and dtype in (torch.bfloat16, torch.float16)
        self.upcast = half and not packable(model.get_output_embeddings().weight)
        int4_ours = quantize == "int4" and all(
            isinstance(w, Int4Weight) and w.ours for L in self.layers for w in (L.wqkv, L.wo, L.wgu, L.wdown))
        dense = (quantize is not None or self.upcast) and not (self.upcast and int4_ours)
        self.dense_rows = PROMPT_DENSE_ROWS if dense else None
        # a bf16 model on dflash's int4 kernel runs the layers of its eager steps in one C++ call (see
        # decoder_layers in csrc/cache_attention.cpp): per layer some thirty small ops dispatched from Python
        # cost more than the layer's products. Same arithmetic, row by row, as _forward.
        self.layer_weights = None
        if self.norm is _kernel_norm and self.cache_kernel and int4_ours:
            self.layer_weights = [t for L in self.layers for t in (
                L.ln1.weight, L.wqkv.qweight, L.wqkv.scales, L.bqkv, _weight(L.q_norm), _weight(L.k_norm),
                L.wo.qweight, L.wo.scales, L.bo, L.ln2.weight, L.wgu.qweight, L.wgu.scales, L.bgu,
                L.wdown.qweight, L.wdown.scales, L.bdown)]
            self.linear_op = self.layers[0].wqkv.op.default._schema.name
            self.eps = _eps(self.layers[0].ln1)
        self._compiled = self._graphed = None
        self.compile_seconds: dict[str, float] = {}  # shape class -> seconds of its first (compiling) call

    def _write(self, layer, ks: torch.Tensor, vs: torch.Tensor, pointer: int, slots: torch.Tensor | None = None):
        """Writes keys/values [b, nkv, q, d] at slots pointer.. of a StaticLayer (or at the slots of the tensor
        `slots`, for a CUDA graph); returns its storage.

        A slice copy, converting to the cache dtype on the way: StaticLayer.update would spend five small ops
        (slot index, counter, two index copies) on it. The layers' own counters stay unused: the adapter's
        pointer is where the slots end (FastTargetAdapter.rewind)."""
        if not layer.is_initialized:
            layer.lazy_initialization(ks.to(self.attn_dtype), vs.to(self.attn_dtype))
        if slots is not None:
            layer.keys.index_copy_(2, slots, ks.to(layer.keys.dtype))
            layer.values.index_copy_(2, slots, vs.to(layer.values.dtype))
            return layer.keys, layer.values
        end = pointer + ks.shape[2]
        layer.keys[:, :, pointer:end] = ks
        layer.values[:, :, pointer:end] = vs
        return layer.keys, layer.values

    @torch.inference_mode()
    def __call__(self, input_ids, position_ids, cache, valid, pointer: int, tap_ids: list[int],
                 logits_to_keep: int = 0, compile: bool = False, tree_mask: torch.Tensor | None = None,
                 head: bool = True):
        """input_ids, position_ids: [b, q] written at slots pointer..pointer+q of `cache` (StaticLayers);
        valid: [b, capacity] committed slots (the new ones included). Returns (logits [b, q', V], taps).
        compile: run decode and verify steps (logits_to_keep=0) through `torch.compile` (see `_compiled_step`);
        prompt passes, one-offs of any length, stay eager. head=False: the final-normed hidden states [b, q', H]
        in place of the logits (eager), for `logits` to turn the rows that are read into logits."""
        if not compile or logits_to_keep or tree_mask is not None or not head:  # candidate trees verify eagerly
            return self._forward(input_ids, position_ids, cache, valid, pointer, tap_ids, logits_to_keep,
                                 tree_mask=tree_mask, head=head)
        b, q = input_ids.shape
        if input_ids.is_cuda:
            return self._graphed_step(input_ids, position_ids, cache, valid, pointer, tap_ids)
        # the flags of the slots in use, as a tensor of their own: a slice of the storage would be contiguous
        # only when the block ends at the last slot, and the graph is specific to that
        valid = valid[:, :pointer + q].clone(memory_format=torch.contiguous_format)
        args = (input_ids, position_ids, cache, valid, pointer, tap_ids, logits_to_keep)
        return self._compiled_step(args, f"{'n rows' if b > 1 else '1 row'} x {'n tokens' if q > 1 else '1 token'}"
                                         f"{', tapped' * bool(tap_ids)}")

    def _compiled_step(self, args: tuple, graph: str):
        """The step through torch.compile, built on first use; `graph` names the graph it runs. Shapes are
        dynamic, so a filling or growing cache, another verify width or batch size does not recompile; torch
        specialises sizes of 1, so one or more rows and one or more tokens are graphs of their own, and so are
        steps that tap hidden states for a draft. Each graph is traced and compiled on its first call, which is
        timed into `compile_seconds` and logged. A FastForward never changes after it is built, so it compiles
        with `compile_frozen`: dynamo does not check its some 300 weight tensors before every step."""
        if self._compiled is None:
            self._compiled = compile_frozen(self._forward, (self.embed, self.rotary, self.final_norm,
                                                            self.head_weight, self.head_bias, *self.layers))
        if graph in self.compile_seconds:
            return self._compiled(*args)
        t = time.perf_counter()
        out = self._compiled(*args)
        self.compile_seconds[graph] = time.perf_counter() - t
        log.info("torch.compile: the %s step took %.1f s to trace and compile", graph, self.compile_seconds[graph])
        return out

    def _graphed_step(self, input_ids, position_ids, cache, valid, pointer: int, tap_ids: list[int]):
        """A decode or verify step on a GPU through torch.compile with CUDA graphs: a step is a few hundred small
        kernels whose launches cost more than their work. A graph replays only what has the same shapes and
        addresses, so this step's shapes do not depend on the pointer: the new keys go to the slots of a
        tensor, attention reads the whole storage (the flags mask what is not committed), and the cache tensors
        are marked as staying put (growing or compacting the cache records the graphs again)."""
        b, q = input_ids.shape
        slots = pointer + torch.arange(q, device=input_ids.device)
        for layer in cache.layers:
            if layer.is_initialized:
                for t in (layer.keys, layer.values):
                    torch._dynamo.mark_static_address(t)
        if self._graphed is None:
            self._graphed = compile_frozen(self._forward, (self.embed, self.rotary, self.final_norm,
                                                           self.head_weight, self.head_bias, *self.layers),
                                           cuda_graphs=True)
        graph = f"{'n rows' if b > 1 else '1 row'} x {q} tokens{', tapped' * bool(tap_ids)}, CUDA graph"
        t = time.perf_counter()
        out = self._graphed(input_ids, position_ids, cache, valid, 0, tap_ids, 0, slots)  # no int that moves
        if graph not in self.compile_seconds:
            self.compile_seconds[graph] = time.perf_counter() - t
        return out

    def _forward(self, input_ids, position_ids, cache, valid, pointer: int, tap_ids: list[int], logits_to_keep: int,
                 write_slots: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None, head: bool = True):
        b, q = input_ids.shape
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        x = self.embed(input_ids)
        cos, sin = rope_tables(self.rotary, x, position_ids)
        cos, sin = cos[:, None], sin[:, None]  # [b, 1, q, d]
        # attention reads only the slots in use, not the whole storage; write_slots (a CUDA graph's step, see
        # _graphed_step) write at the slots of that tensor and read the whole storage
        end = valid.shape[1] if write_slots is not None else pointer + q
        valid = valid[:, :end]
        # slot j is visible to query i if it is committed and not after the query's own slot; a query always
        # sees its own slot, so a padding query attends to something and its states stay finite
        slots = torch.arange(end, device=valid.device)
        own = (write_slots if write_slots is not None else pointer + torch.arange(q, device=valid.device))[:, None]
        visible = ((valid[:, None, :] & (slots <= own)[None]) | (slots == own)[None])[:, None]  # [b, 1, q, end]
        if tree_mask is not None:  # a candidate tree: among the new tokens, a node sees itself and its ancestors
            visible = torch.cat([visible[..., :pointer], tree_mask[:, None]], -1)
        # decode and verify steps (trees of any size included) always, so that each query is computed the same
        # way whatever the step; prompt passes of many tokens are faster through SDPA
        few = self.cache_kernel and (logits_to_keep == 0 or q <= CACHE_KERNEL_QUERIES)
        # a CPU cache in bf16 is read by SDPA in fp32 (its bf16 kernels are slow there)
        sdpa_dtype = torch.float32 if (self.cache_kernel and self.attn_dtype != torch.float32) else self.attn_dtype
        # additive, made once: SDPA would turn a boolean mask into one in every layer
        mask = None if few else torch.zeros(visible.shape, dtype=sdpa_dtype, device=visible.device).masked_fill_(
            ~visible, float("-inf"))
        taps = {}
        tap_set = set(tap_ids)
        dense = self.dense_rows is not None and logits_to_keep > 0 and q >= self.dense_rows

        def mm(x, w, b, parts):
            return _dense_linear(x, parts, self.upcast) if dense else _linear(x, w, b)
        # eager steps only: a compiled step traces the Python layers
        if self.layer_weights is not None and few and not dense and write_slots is None and \
                not torch.compiler.is_compiling():
            for layer in cache.layers:
                if not layer.is_initialized:
                    kv = x.new_empty(b, nkv, 1, d)
                    layer.lazy_initialization(kv, kv)
            taps_sorted = sorted(tap_set)
            x, tapped = torch.ops.dflash_attn.decoder_layers(
                x, cos[:, 0], sin[:, 0], visible[:, 0], pointer, [c.keys for c in cache.layers],
                [c.values for c in cache.layers], self.layer_weights, taps_sorted, nh, nkv, self.eps, self.scaling,
                self.linear_op)
            taps = dict(zip(taps_sorted, tapped))
            layers = ()
        else:
            layers = zip(self.layers, cache.layers)
        for i, (L, layer_cache) in enumerate(layers):
            h = self.norm(L.ln1, x)
            qkv = mm(h, L.wqkv, L.bqkv, L.parts[0])
            qk, vs = qkv.split([(nh + nkv) * d, nkv * d], dim=-1)
            qk = qk.view(b, q, nh + nkv, d)
            if L.q_norm is not None:
                qk = torch.cat([self.norm(L.q_norm, qk[:, :, :nh]), self.norm(L.k_norm, qk[:, :, nh:])], 2)
            # RoPE on the query and key heads together: half the small ops of rotating each
            qk = qk.transpose(1, 2)  # [b, nh + nkv, q, d]
            qk = qk * cos + qk.roll(d // 2, -1) * sin
            qs, ks = qk[:, :nh], qk[:, nh:]
            vs = vs.view(b, q, nkv, d).transpose(1, 2)
            keys, values = self._write(layer_cache, ks, vs, pointer, write_slots)
            if few:
                # in fp32 inside the kernel, the output rounded to the queries' dtype
                o = torch.ops.dflash_attn.cache_attention(qs, keys[:, :, :end], values[:, :, :end], visible[:, 0],
                                                          self.scaling)
            else:
                ks, vs = keys[:, :, :end].to(sdpa_dtype), values[:, :, :end].to(sdpa_dtype)
                if self.expand_kv:
                    ks, vs = ks.repeat_interleave(nh // nkv, 1), vs.repeat_interleave(nh // nkv, 1)
                o = F.scaled_dot_product_attention(qs.to(sdpa_dtype), ks, vs, attn_mask=mask, scale=self.scaling,
                                                   enable_gqa=self.gqa and not self.expand_kv)
            x = x + mm(o.to(x.dtype).transpose(1, 2).reshape(b, q, nh * d), L.wo, L.bo, L.parts[1])
            act = self.silu_mul(mm(self.norm(L.ln2, x), L.wgu, L.bgu, L.parts[2]))
            x = x + mm(act, L.wdown, L.bdown, L.parts[3])
            if i in tap_set:
                taps[i] = x
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        x = self.norm(self.final_norm, x)
        return (self.logits(x) if head else x), taps

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [..., H] -> logits [..., V]."""
        return _linear(hidden, self.head_weight, self.head_bias)


def fast_forward(model, quantize: str | None = None) -> FastForward:
    """The model's FastForward (per quantisation), built on first use and kept with the model."""
    built = model.__dict__.setdefault("_dflash_fast_forward", {})
    if quantize not in built:
        built[quantize] = FastForward(model, quantize)
    return built[quantize]


def compile_seconds(model) -> dict[str, float]:
    """Seconds that each compiled step graph of `model` took to build so far (runtimes '*-compile')."""
    built = model.__dict__.get("_dflash_fast_forward", {})
    return {f"{graph} ({quantize or 'plain'})": sec for quantize, ff in built.items()
            for graph, sec in ff.compile_seconds.items()}


_FAST_RUNTIMES = ("fast", "fast-int8", "fast-int4")
RUNTIMES = ("auto", *_FAST_RUNTIMES, *(f"{r}-compile" for r in _FAST_RUNTIMES), "hf")


INT4_GRIDS = ("Q4_0", "Q4_1")  # GGUF weight types that the int4 runtime's layout holds exactly (w = q*scale + low)


def resolve_runtime(model, runtime: str = "auto") -> str:
    """The runtime `auto` stands for: a model shipped as a 4-bit GGUF (Q4_0, Q4_1), run in bf16 on a CPU where
    dflash's int4 kernel works, runs 'fast-int4': the weights on the grid they were shipped on, as llama.cpp runs
    them, and every product, attention and norm of a step batch-invariant, so DFlash output is plain decoding's
    bit for bit. Any other model the lean path covers runs 'fast' in its own dtype; the rest 'hf'."""
    if runtime != "auto":
        return runtime
    if fast_unsupported(model) is not None:
        return "hf"
    param = next(model.parameters())
    if (param.device.type == "cpu" and param.dtype == torch.bfloat16 and
            getattr(model.config, "dflash_gguf_weights", None) in INT4_GRIDS and int4_kernel()):
        return "fast-int4"
    return "fast"


def make_adapter(model, layer_ids: list[int] | None, runtime: str = "auto") -> TargetAdapter:
    """The target adapter for `runtime`: 'fast' (the lean path), 'fast-int8' / 'fast-int4' (the lean path with
    weight-only quantised linear layers: a different target), any of these with '-compile' (its decode and
    verify steps through torch.compile), 'hf' (the model's own forward) or 'auto' (see resolve_runtime)."""
    if runtime not in RUNTIMES:
        raise DFlashConfigError(f"unknown runtime {runtime!r} (choose from {', '.join(RUNTIMES)})")
    runtime = resolve_runtime(model, runtime)
    compile = runtime.endswith("-compile")
    runtime = runtime.removesuffix("-compile")
    device = next(model.parameters()).device
    if runtime.startswith("fast-") and device.type != "cpu":
        raise DFlashConfigError(f"runtime {runtime!r} is CPU-only (its weight-only {runtime[5:]} kernels are "
                                f"PyTorch's and dflash's CPU kernels); on {device.type} use runtime 'fast' or 'hf'")
    if runtime.startswith("fast-"):
        return FastTargetAdapter(model, layer_ids, quantize=runtime.removeprefix("fast-"), compile=compile)
    if runtime == "fast":
        return FastTargetAdapter(model, layer_ids, compile=compile)
    return TargetAdapter(model, layer_ids)


class FastTargetAdapter(TargetAdapter):
    """TargetAdapter whose forward is the lean path; the cache and its operations are the same."""

    def __init__(self, model, layer_ids: list[int] | None = None, quantize: str | None = None,
                 compile: bool = False):
        super().__init__(model, layer_ids)
        self.fast = fast_forward(model, quantize)
        self.compile = compile

    @property
    def lazy_head(self) -> bool:
        # on a CPU the output layer is a verify step's largest product (SmolLM2-135M: 28M of its 135M weights),
        # and a step reads the logits of few of its rows: mostly those up to the first rejected draft token.
        # Reading which ones costs a read back to the host, nothing on a CPU (a GPU's step keeps its one).
        return not self.compile and self.device.type == "cpu"

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fast.logits(hidden)

    def rewind(self, n: int) -> None:
        # the pointer alone: the lean forward writes at it and never reads the cache layers' counters (HF's
        # crop would step 30 of them back, one small op each)
        if n > 0:
            self.pointer -= n

    def _run(self, input_ids, position_ids, tap_ids, logits_to_keep, tree_mask=None, head=True):
        return self.fast(input_ids, position_ids, self.cache, self.valid, self.pointer, tap_ids, logits_to_keep,
                         self.compile, tree_mask, head)
