"""Linear layers with the weight laid out once for oneDNN, for inference on the CPU.

In bf16/fp16 on a CPU, `F.linear` goes through oneDNN, which reorders the (plain row-major) weight into its
blocked layout on every call. For the skinny inputs of decoding (1 to 16 rows) that reorder costs about as much
as the product itself (see the target forward time of `benchmarks/profile_step.py`). Packing once gives bitwise
identical results: the same oneDNN kernel runs, only the reorder moves out of the loop. fp32 goes to a different BLAS whose
summation order differs, so fp32 keeps `F.linear`: the fp32 paths stay bit-comparable with the HF model.

Where oneDNN cannot pack (an AVX2-only CPU has no bf16/fp16 kernels), PyTorch's fallback half-precision
product costs about linearly in the rows: 8 rows cost 7 times one (`benchmarks/linear_rows.py`), where fp32
costs 2 to 3 times. There `linear` multiplies by the weight quantised to Q8_0 on dflash's kernel (groups of 32
with one scale: a quarter of fp32's bytes, and 8 rows cost little more than one; a draft's propose step on an
AVX2 CPU spent most of its time in fp32 products), or, where that kernel does not run or the shape does not
fit it, from WIDEN_ROWS rows on in fp32 by a widened copy of the weight, rounding the result back. Neither is
bitwise the half-precision product, which is fine for what uses this module: the drafts, whose proposals the
target verifies (the target's fast runtime has its own rule, see `dflash.fast`).

It also holds the weight-only int8 / int4 weights that the fast runtime's quantised targets multiply by, and that
the drafts score their proposals with where the CPU has no half kernels: PyTorch's CPU kernels, and for int4 on
x86 CPUs with AVX-512 VNNI or AVX2 our own (`csrc/int4.cpp`, built on first use), whose cost grows slowly with the rows
(see `Int4Weight`). And `argmax` over logits rows, which PyTorch's CPU kernel does slowly in bf16.

Packed, quantised and widened copies are cached per weight tensor and rebuilt when the weight changes in place (a training
step) or is replaced; training itself (grad enabled) always takes `F.linear`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import os
import platform
import warnings
from pathlib import Path
from weakref import WeakValueDictionary

try:
    import fcntl
except ImportError:  # not POSIX: no kernel build to guard (they are x86 Linux builds)
    fcntl = None

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from .errors import DFlashConfigError
from .machine import cpu_flags, cpu_has, dflash_home, max_cpu_isa

_PACKABLE_DTYPES = (torch.bfloat16, torch.float16)
_packed = WeakIdKeyDictionary()  # weight -> ((version, data_ptr), packed weight)
_widened = WeakIdKeyDictionary()  # weight -> ((version, data_ptr), fp32 copy)
_eight_bit = WeakIdKeyDictionary()  # weight -> ((version, data_ptr), Q8Weight)
WIDEN_ROWS = 4
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


# what oneDNN's packed half-precision products need: AVX-512 (bw/vl/dq) or AVX-NE-CONVERT for bf16,
# AVX512-FP16 or AVX-NE-CONVERT for fp16
_PACK_FLAGS = {torch.bfloat16: ({"avx512bw", "avx512vl", "avx512dq"}, {"avx_ne_convert"}),
               torch.float16: ({"avx512_fp16"}, {"avx_ne_convert"})}


def _cpu_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN packs weights of this dtype. The CPU's flags rule it out (DFLASH_MAX_CPU_ISA
    included, see dflash.machine); where they allow it, oneDNN's own check is the authority."""
    if any(cpu_has(*flags) is not False for flags in _PACK_FLAGS[dtype]):
        return _onednn_packs(dtype)
    return False


@functools.cache
def _onednn_packs(dtype: torch.dtype) -> bool:
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


def fast_bf16(device: torch.device | str) -> bool:
    """Whether bf16 products pay on `device`: on a GPU, and on a CPU whose oneDNN packs bf16 weights. Elsewhere
    (AVX2 only) PyTorch's bf16 matrix products fall back to a generic loop many times slower than fp32."""
    device = torch.device(device)
    return device.type != "cpu" or (_ONEDNN and _cpu_packs(torch.bfloat16))


def packable(w: torch.Tensor) -> bool:
    """Whether products with weight w [out, in] are exact and faster through a prepacked oneDNN weight."""
    return (_ONEDNN and w.device.type == "cpu" and w.dtype in _PACKABLE_DTYPES and w.dim() == 2
            and _cpu_packs(w.dtype))


class PackedWeight:
    """A weight [out, in] packed once; the fast runtime holds these for its frozen weight snapshots.

    Inside torch.compile the product goes through the opaque op `dflash::packed_linear`, which names the weight
    by a key: the packed tensor has oneDNN's own layout, which neither fake tensors nor inductor's lowering of
    `_linear_pointwise` (made for the weights its own freezing packs) can take as a graph input."""

    def __init__(self, w: torch.Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)
        self.out_features = w.shape[0]
        self.key = f"w{next(_keys)}"
        _by_key[self.key] = self

    def linear(self, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.dflash.packed_linear(x, self.key, b)
        return _packed_product(x, self.packed, b)


def _packed_product(x: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, b, "none", [], "")


_by_key: "WeakValueDictionary[str, PackedWeight]" = WeakValueDictionary()
_keys = itertools.count()


@torch.library.custom_op("dflash::packed_linear", mutates_args=())
def _packed_linear(x: torch.Tensor, key: str, b: torch.Tensor | None) -> torch.Tensor:
    return _packed_product(x, _by_key[key].packed, b)


@_packed_linear.register_fake
def _(x: torch.Tensor, key: str, b: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], _by_key[key].out_features)


def _derived(table: WeakIdKeyDictionary, w: torch.Tensor, make):
    """make(w), cached in `table`: made on first use and again whenever w has changed in place or been replaced."""
    # an inference tensor (made under inference_mode, e.g. a fused weight) keeps no version counter
    key = (None if w.is_inference() else w._version, w.data_ptr())
    entry = table.get(w)
    if entry is None or entry[0] != key:
        entry = table[w] = (key, make(w))
    return entry[1]


def packed_weight(w: torch.Tensor) -> PackedWeight:
    """w packed (cached, see `_derived`)."""
    return _derived(_packed, w, PackedWeight)


def widens(w: torch.Tensor) -> bool:
    """Whether the half-precision CPU weight w has no packed kernel here: `linear` then multiplies by it in Q8_0
    or, from WIDEN_ROWS rows on, in fp32."""
    return w.device.type == "cpu" and w.dtype in _PACKABLE_DTYPES and not packable(w)


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b), through the packed weight where that is exact and faster, or for several rows in fp32
    where the CPU has no half-precision kernels (see the module doc). w may also be a quantised weight
    (Int8Weight, Int4Weight), multiplied by its own kernel."""
    if not isinstance(w, torch.Tensor):
        return w.linear(x, b)
    if torch.compiler.is_compiling() and not torch.is_grad_enabled():
        # the packed and widened copies are caches, remade when the weight changes: inside a compiled graph
        # the product is one opaque op that picks them when it runs (a compiled training step differentiates
        # F.linear instead)
        return torch.ops.dflash.linear(x, w, b)
    if x.dtype != w.dtype or torch.is_grad_enabled() or (b is not None and b.dtype != w.dtype):
        return F.linear(x, w, b)
    if packable(w):
        return packed_weight(w).linear(x, b)
    if widens(w) and Q8Weight.fits(w):
        return _derived(_eight_bit, w, Q8Weight).linear(x, b)
    if widens(w) and x.numel() >= WIDEN_ROWS * x.shape[-1]:
        wide = _derived(_widened, w, lambda t: t.detach().float())
        return F.linear(x.float(), wide, None if b is None else b.float()).to(x.dtype)
    return F.linear(x, w, b)


@torch.library.custom_op("dflash::linear", mutates_args=())
def _linear_op(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return linear(x, w, b)


@_linear_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], w.shape[0])


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state dict) whose inference forward uses `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class _WeightOnlyQuantized:
    """A quantised weight whose PyTorch kernel takes 2-D inputs and no bias (`_matmul`)."""

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self._matmul(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        return y if bias is None else y + bias


def by_rows(w: torch.Tensor, group: int, quantize, rows: int = 1024) -> list[torch.Tensor]:
    """quantize(fp32 groups [r, in/group, group]) -> (q [r, in], per-group tensors [r, in/group]...) over w's rows a
    block at a time, joined: the fp32 temporaries of a block stay in cache where the whole weight's would stream
    through memory several times (the default model's 49152 x 576 head as Q8_0: 75 ms against 225 ms in one piece on
    an AMD EPYC with AVX-512, 2 threads; a first generation, which prepares the runtime's weights, came 0.15-0.3 s
    sooner). The same values as in one piece."""
    out_features, in_features = w.shape
    parts = [quantize(w[r:r + rows].detach().float().view(-1, in_features // group, group))
             for r in range(0, out_features, rows)]
    return [p[0] if len(p) == 1 else torch.cat(p) for p in zip(*parts)]


class Int8Weight(_WeightOnlyQuantized):
    """A weight quantised per output row to int8 (symmetric), multiplied by PyTorch's weight-only int8 kernel:
    half the bytes of bf16 to stream through memory per token."""

    def __init__(self, w: torch.Tensor):
        def rows(g):  # [r, 1, in]: a row is one group
            scale = g.abs().amax(-1).clamp(min=1e-12) / 127
            return (g / scale[..., None]).round().clamp(-127, 127).to(torch.int8).flatten(1), scale.flatten()

        self.qweight, scale = by_rows(w, w.shape[1], rows)
        self.scale = scale.to(w.dtype)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.qweight, self.scale)


# builds of dflash's int4 kernel (csrc/int4.cpp), best first: the CPU flags each needs and its compiler flags (the
# AMX build is the VNNI one with tile products for batches of 10 rows or more; the AVX-VNNI build is the AVX2 one
# with vpdpbusd on 8 lanes)
_VNNI = ({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma", "f16c"},
         ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c"])
_AVX2 = ({"avx2", "fma", "f16c"}, ["-mavx2", "-mfma", "-mf16c"])
INT4_BUILDS = {"avx512_amx": (_VNNI[0] | {"amx_tile", "amx_int8"}, [*_VNNI[1], "-mamx-tile", "-mamx-int8"]),
               "avx512_vnni": _VNNI,
               "avx_vnni": (_AVX2[0] | {"avx_vnni"}, [*_AVX2[1], "-mavxvnni"]),
               "avx2": _AVX2}
# the AVX-VNNI build's code with its one VNNI instruction emulated exactly by AVX2 ones, for tests on CPUs without
# AVX-VNNI; never chosen to run a model
INT4_EMULATED = {"avx_vnni_emulated": (_AVX2[0], [*_AVX2[1], "-DDFLASH_EMULATE_AVX_VNNI"])}
INT4_KERNELS = ("auto", "dflash", "torch")


def int4_kernel_choice() -> str:
    choice = os.environ.get("DFLASH_INT4_KERNEL", "auto")
    if choice not in INT4_KERNELS:
        raise DFlashConfigError(f"DFLASH_INT4_KERNEL={choice!r}: expected one of {', '.join(INT4_KERNELS)}")
    return choice


def int4_build() -> str | None:
    """The build of dflash's int4 kernel this CPU runs (see INT4_BUILDS; DFLASH_MAX_CPU_ISA applies), if any."""
    flags = cpu_flags() or set()
    return next((name for name, (needs, _) in INT4_BUILDS.items() if needs <= flags), None)


def int4_kernel() -> bool:
    """Whether int4 products run on dflash's own kernel (`csrc/int4.cpp`): an x86 CPU with AVX-512 VNNI, or AVX2
    with FMA and F16C, and a C++ compiler; built once per PyTorch version under DFLASH_HOME/kernels.
    DFLASH_INT4_KERNEL=torch keeps PyTorch's kernel; =dflash makes a failed build an error instead of a warning."""
    choice = int4_kernel_choice()
    if choice == "torch":
        return False
    build = int4_build()
    problem = "this CPU has neither AVX-512 VNNI nor AVX2 with FMA and F16C" if build is None else _int4_build(build)
    if problem is None:
        return True
    if choice == "dflash":
        raise DFlashConfigError(f"DFLASH_INT4_KERNEL=dflash, but dflash's int4 kernel is unavailable: {problem}")
    if build is not None and "int4" not in _warned:  # no compiler, no headers: PyTorch's kernel still works
        _warned.append("int4")
        warnings.warn(f"dflash's int4 kernel did not build, int4 layers use PyTorch's: {problem}", stacklevel=2)
    return False


def int4_op(build: str | None = None, name: str = "int4_linear"):
    """A product of a build of dflash's kernel library (default: this CPU's), once built: op(x bf16 [M, K],
    qweight, scales). name: int4_linear (Int4Weight) or q8_linear (Q8Weight)."""
    return getattr(getattr(torch.ops, f"dflash_int4_{build or int4_build()}"), name)


_warned: list[str] = []


@contextlib.contextmanager
def _build_lock(folder: Path):
    """Held while a kernel library is built or loaded from `folder`. PyTorch's own lock there is a file that a
    process killed mid-build (Ctrl-C during a first run) leaves behind, and every later process then waits on it
    forever, silently. This one is an flock, which the OS lets go when its holder dies; who holds it is the only
    dflash process in the folder, so a PyTorch lock file found then is stale, and goes."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "dflash-build.lock", "a") as f:
        if fcntl is not None:  # (without it, PyTorch's lock is left as it is)
            fcntl.flock(f, fcntl.LOCK_EX)
            (folder / "lock").unlink(missing_ok=True)
        yield


@functools.cache
def _int4_build(build: str) -> str | None:
    """Builds (or finds built) and loads one build of the kernel, once per process: a library registers its op
    once. Returns why it is unavailable, None when loaded."""
    lib = f"dflash_int4_{build}"
    try:
        from torch.utils.cpp_extension import load

        folder = dflash_home() / "kernels" / f"torch-{torch.__version__}"
        with _build_lock(folder):
            load(name=lib, sources=[str(Path(__file__).parent / "csrc" / "int4.cpp")],
                 extra_cflags=["-O3", *(INT4_BUILDS | INT4_EMULATED)[build][1], f"-DDFLASH_INT4_LIB={lib}",
                               "-fopenmp"],
                 extra_ldflags=["-fopenmp"], build_directory=str(folder), is_python_module=False)
    except Exception as e:
        return str(e)
    torch.library.register_fake(f"{lib}::int4_linear")(
        lambda x, qweight, scales: x.new_empty(x.shape[0], qweight.shape[0] * 16))
    torch.library.register_fake(f"{lib}::q8_linear")(
        lambda x, qweight, scales: x.new_empty(x.shape[0], qweight.shape[0] * 8))
    return None


def cache_attention_kernel() -> bool:
    """Whether the CPU's decode and verify attention runs on dflash's kernel (`csrc/cache_attention.cpp`): each
    cached key and value read once for all the queries and heads that share it, from a cache in the model's
    dtype, and every query computed alike whatever else is in the step (see the source). Built on first use for
    this CPU (-march=native, or AVX2 under DFLASH_MAX_CPU_ISA=avx2 or avx_vnni: it has no integer products).
    DFLASH_ATTENTION_KERNEL=torch keeps PyTorch's SDPA."""
    if os.environ.get("DFLASH_ATTENTION_KERNEL", "auto") == "torch":
        return False
    problem = _attention_build()
    if problem is not None and "attention" not in _warned:
        _warned.append("attention")
        warnings.warn(f"dflash's attention kernel did not build, attention uses PyTorch's: {problem}", stacklevel=2)
    return problem is None


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1), bit for bit what it answers (the first of equal maxima, a NaN above everything), on dflash's
    kernel for CPU tensors of fp32 or bf16 where the attention kernel's library runs: PyTorch's CPU argmax
    takes 1.7 ms over 8 bf16 rows of a 49k vocabulary here, a verify step's choices. Elsewhere PyTorch's."""
    if (x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.dim() == 0 or x.numel() == 0
            or torch.compiler.is_compiling() or not cache_attention_kernel()):
        return x.argmax(-1)
    return torch.ops.dflash_attn.argmax(x.reshape(-1, x.shape[-1])).view(x.shape[:-1])


@functools.cache
def _attention_build() -> str | None:
    """Builds (or finds built) and loads the attention kernel for this CPU, once per process."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"no build for {platform.machine()} yet"
    isa = max_cpu_isa()
    arch = ["-march=native"] if isa == "native" else ["-mavx2", "-mfma", "-mf16c"]
    # -fno-trapping-math: loops with selects (SiLU, exp, rounding) vectorise; no value changes (no reassociation)
    flags = ["-O3", "-fopenmp", "-fno-trapping-math", *arch]
    # -march=native code is for this CPU only: its build folder is named by the CPU's flags
    cpu = hashlib.sha256(" ".join(sorted(cpu_flags() or [])).encode()).hexdigest()[:12]
    try:
        from torch.utils.cpp_extension import load

        build = dflash_home() / "kernels" / f"torch-{torch.__version__}" / f"attention-{isa}-{cpu}"
        with _build_lock(build):
            load(name=f"dflash_attention_{isa}", sources=[str(Path(__file__).parent / "csrc" / "cache_attention.cpp")],
                 extra_cflags=flags, extra_ldflags=["-fopenmp"], build_directory=str(build), is_python_module=False)
    except Exception as e:
        return str(e)
    torch.library.register_fake("dflash_attn::cache_attention")(lambda q, k, v, visible, scale: q.new_empty(q.shape))
    torch.library.register_fake("dflash_attn::rms_norm")(lambda x, weight, eps: x.new_empty(x.shape))
    torch.library.register_fake("dflash_attn::argmax")(lambda x: x.new_empty(x.shape[0], dtype=torch.long))
    torch.library.register_fake("dflash_attn::silu_mul")(lambda gu: gu.new_empty(*gu.shape[:-1], gu.shape[-1] // 2))
    return None


class Int4Weight(_WeightOnlyQuantized):
    """A weight quantised to 4 bits in groups of 32 inputs, each with its own scale and offset (asymmetric): the
    layout of GGUF's Q4_1, so a model shipped as Q4_1 and de-quantised on load comes back to (almost exactly)
    the grid it was stored on.

    Where `int4_kernel()` holds (and the outputs are a multiple of 16), products run on dflash's kernel with
    llama.cpp's arithmetic: each row's inputs quantised to int8 per group of 32, products summed in int32. Its
    cost grows slowly with the rows (30 layers of SmolLM2-135M's products: 8 rows cost under 2x one row, where
    PyTorch's kernel costs 3x; `benchmarks/linear_rows.py`), and a row's result does not depend on the other
    rows. Elsewhere PyTorch's weight-only int4 kernel, w = (q - 8) * scale + zero de-quantised on the fly.
    Either way a quarter of the bytes of bf16 per token."""

    GROUP = 32

    @staticmethod
    def fits(w: torch.Tensor) -> bool:
        """Whether w can run on dflash's kernel here."""
        return w.device.type == "cpu" and w.shape[0] % 16 == 0 and w.shape[1] % Int4Weight.GROUP == 0 and int4_kernel()

    def __init__(self, w: torch.Tensor, ours: bool | None = None):
        """ours: whether to use dflash's kernel (None: where it is available)."""
        out_features, in_features = w.shape
        if in_features % self.GROUP:
            raise DFlashConfigError(f"int4 needs the input size of every linear layer to be a multiple of "
                                    f"{self.GROUP}; a weight has {in_features}")

        def q4_1(g):
            low = g.amin(-1)  # [r, groups]
            scale = ((g.amax(-1) - low) / 15).clamp(min=1e-12)
            return ((g - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).flatten(1), low, scale

        q, low, scale = by_rows(w, self.GROUP, q4_1)  # [out, in], [out, groups] x 2
        self.ours = ours is not False and self.fits(w)
        if ours and not self.ours:
            raise DFlashConfigError(f"dflash's int4 kernel cannot take a weight of {out_features} outputs on "
                                    f"{w.device} here (it needs a multiple of 16, on an x86 CPU with AVX-512 VNNI or "
                                    f"AVX2)")
        if self.ours:  # the layout csrc/int4.cpp documents
            self.op = int4_op()
            tiles, octets = out_features // 16, in_features // 8
            nibbles = q.view(tiles, 16, octets, 2, 4).permute(0, 2, 1, 4, 3)  # [tile, octet, output, input, half]
            self.qweight = (nibbles[..., 0] | nibbles[..., 1] << 4).to(torch.uint8).reshape(tiles, octets, 64)
            self.qweight = self.qweight.contiguous()
            self.scales = (torch.stack([scale, low]).view(2, tiles, 16, -1).permute(1, 3, 0, 2)
                           .contiguous().half())  # [tile, group, scale/low, output]: fp16, as Q4_1 stores them
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            zero = low + 8 * scale
            self.scales_and_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(w.dtype)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.ours:
            return self.op(x.to(torch.bfloat16), self.qweight, self.scales).to(x.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.GROUP, self.scales_and_zeros)


class Q8Weight(_WeightOnlyQuantized):
    """A weight in GGUF's Q8_0 layout: int8 in groups of 32 inputs, one fp16 scale each (symmetric). GGUF files
    keep the token embedding, the tied LM head, this way while the layers are 4-bit, so the int4 runtime's head is
    one of these. Multiplied on dflash's kernel (`q8_linear` in csrc/int4.cpp) with llama.cpp's Q8_0 x Q8
    arithmetic: a row's result does not depend on the other rows, and 8 rows cost far less than 8 times one
    (PyTorch's int8 kernel: about linear in the rows). Only where `fits` holds; elsewhere Int8Weight."""

    GROUP = 32

    @staticmethod
    def fits(w: torch.Tensor) -> bool:
        return w.device.type == "cpu" and w.shape[0] % 8 == 0 and w.shape[1] % Q8Weight.GROUP == 0 and int4_kernel()

    def __init__(self, w: torch.Tensor):
        if not self.fits(w):
            raise DFlashConfigError(f"a Q8_0 weight needs dflash's kernel, outputs a multiple of 8 and inputs a "
                                    f"multiple of {self.GROUP}; got {tuple(w.shape)}")
        out_features, in_features = w.shape

        def q8_0(g):
            scale = (g.abs().amax(-1) / 127).clamp(min=1e-12)  # [r, groups]
            return (g / scale[..., None]).round().clamp(-127, 127).to(torch.int8).flatten(1), scale

        q, scale = by_rows(w, self.GROUP, q8_0)
        self.op = int4_op(name="q8_linear")
        tiles = out_features // 8
        # the layout csrc/int4.cpp documents: [tile, quad, output, input]
        self.qweight = q.view(tiles, 8, in_features // 4, 4).permute(0, 2, 1, 3).reshape(tiles, -1, 32).contiguous()
        self.scales = scale.view(tiles, 8, -1).permute(0, 2, 1).contiguous().half()  # [tile, group, output]

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x.to(torch.bfloat16), self.qweight, self.scales).to(x.dtype)


def int8_weight(w: torch.Tensor):
    """w at 8 bits: Q8_0 on dflash's kernel where that runs (the cheapest per row; `benchmarks/linear_rows.py`),
    else int8 per row on PyTorch's kernel."""
    return Q8Weight(w) if Q8Weight.fits(w) else Int8Weight(w)


def proposal_weight(w: torch.Tensor):
    """A draft's LM head in the form it scores proposals with. Where the CPU has no half-precision kernels the bf16
    head costs about linearly in the rows it scores and fp32 streams twice the bytes: there it is 8-bit
    (`int8_weight`; PyTorch's int8 scored 7 rows in the time of 2 bf16 ones). A bf16 head is Q8_0 wherever
    dflash's kernel runs, also where oneDNN packs bf16: a step's few rows stream half the bytes (the default
    draft's propose, AVX-512 Xeon with AMX, 2 threads: 0.9-1.1 ms against 1.2)."""
    return int8_weight(w) if widens(w) or (w.dtype == torch.bfloat16 and Q8Weight.fits(w)) else w
