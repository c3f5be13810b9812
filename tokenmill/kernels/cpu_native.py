"""The C kernels of kernels/cpu/, compiled at first use for this host and loaded through ctypes.

Why C through ctypes, not a torch C++ extension: the kernels need raw pointers and OpenMP only, so they build from
one small C file in about a second with the C compiler that torch.compile's inductor already needs on a CPU (no
torch headers, no build step at install, nothing to go stale against a torch upgrade). ``-march=native`` makes
each build the host's own (AVX2, AVX-512, ...), so the library is cached per source, compiler flags and CPU model
under ``~/.cache/tokenmill/kernels`` (a shared cache directory across hosts gets one library per CPU model). No
compiler, or a failed build: ``library()`` is None and callers use the PyTorch references (a warning says why).

The OpenMP runtime is the process's: torch's wheels load libgomp first, and the library links to it by soname.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).parent / "cpu" / name
                for name in ("paged_attention.c", "prefill_attention.c", "quant_linear.c", "quant_linear_x16.c",
                             "argmax.c", "gated_activation.c", "rotary.c", "decoder.c"))
# Included by the sources: part of what a build (and a measurement of it) is keyed on.
HEADERS = tuple(Path(__file__).parent / "cpu" / name for name in ("simd_common.h", "prefill_attention.h"))
# fast-math's reassociation lets the reductions and expf vectorize (glibc's libmvec); finite sentinels are used in
# place of infinities inside the loops.
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=256", "-fopenmp", "-ffast-math", "-fPIC", "-shared")
# Extra compiler flags, appended (e.g. "-mno-avx512f" builds the AVX2 kernels on an AVX-512 host: how the tests
# cover both builds on one machine).
EXTRA_FLAGS_ENV = "TOKENMILL_CPU_KERNEL_FLAGS"
DEFAULT_CACHE_DIR = "~/.cache/tokenmill/kernels"

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def cpu_identity() -> str:
    """This CPU's model name and flags (what -march=native and a measured choice depend on)."""
    try:
        with open("/proc/cpuinfo") as fh:
            lines = [line for line in fh if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def source_digest() -> str:
    """A short hash of the kernels' sources: what a measurement of them is only valid for."""
    key = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        key.update(source.read_bytes())
    return key.hexdigest()[:12]


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build(cache_dir: Path) -> ctypes.CDLL | None:
    compiler = _compiler()
    if compiler is None:
        log.warning("CPU kernels: no C compiler found (cc, gcc, clang): the PyTorch references run instead")
        return None
    flags = (*FLAGS, *os.environ.get(EXTRA_FLAGS_ENV, "").split())
    key = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        key.update(source.read_bytes())
    key.update(" ".join((compiler, *flags, cpu_identity(), platform.machine())).encode())
    target = cache_dir / f"tokenmill_cpu_{key.hexdigest()[:16]}.so"
    if not target.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
            built = Path(tmp) / target.name
            cmd = [compiler, *flags, *map(str, SOURCES), "-o", str(built), "-lm"]
            try:
                result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.TimeoutExpired) as exc:
                log.warning("CPU kernels: %s failed (%s): the PyTorch references run instead", compiler, exc)
                return None
            if result.returncode != 0:
                log.warning("CPU kernels: %s failed: the PyTorch references run instead\n%s", " ".join(cmd),
                            result.stderr[-2000:])
                return None
            os.replace(built, target)  # atomic: a concurrent builder finds a whole library or none
    lib = ctypes.CDLL(str(target))
    lib.tm_init()
    lib.tm_paged_attention.restype = ctypes.c_int
    lib.tm_paged_attention.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float,
        ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.tm_paged_attention_bf16.restype = ctypes.c_int
    lib.tm_paged_attention_bf16.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float,
        ctypes.c_float, ctypes.c_int]
    lib.tm_set_attention_prefetch.argtypes = [ctypes.c_int]
    lib.tm_set_attention_prefetch.restype = None
    lib.tm_attention_prefetch.restype = ctypes.c_int
    lib.tm_write_kv.restype = ctypes.c_int
    lib.tm_write_kv.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                ctypes.c_int64]
    lib.tm_quant_linear.restype = ctypes.c_int
    lib.tm_quant_linear.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_int64]
    lib.tm_quant_linear_prepared.restype = ctypes.c_int
    lib.tm_quant_linear_prepared.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.tm_x16_register_rows.restype = ctypes.c_int
    lib.tm_quantize_blocks.restype = None
    lib.tm_quantize_blocks.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.tm_argmax_rows.restype = None
    lib.tm_argmax_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.tm_amx_available.restype = ctypes.c_int
    lib.tm_silu_mul.restype = None
    lib.tm_silu_mul.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                ctypes.c_int, ctypes.c_int]
    lib.tm_rope_qk.restype = ctypes.c_int
    lib.tm_rope_qk.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    for name in ("tm_prefill_attention_amx", "tm_prefill_attention_avx512"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
            ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    lib.tm_decoder_stack.restype = ctypes.c_int
    lib.tm_decoder_stack.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.tm_quant_linear_x16.restype = ctypes.c_int
    lib.tm_quant_linear_x16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                        ctypes.c_void_p, ctypes.c_int]
    return lib


class QuantWeight(ctypes.Structure):
    """kernels/cpu/quant_linear.c's tm_quant_weight: one weight's constant arguments."""
    _fields_ = [("q", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("mins", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("K", ctypes.c_int64), ("N", ctypes.c_int64), ("G", ctypes.c_int64),
                ("tile_rows", ctypes.c_int64), ("scales_f32", ctypes.c_int32), ("mins_f32", ctypes.c_int32),
                ("kind", ctypes.c_int32), ("unused", ctypes.c_int32)]


class X16Weight(ctypes.Structure):
    """kernels/cpu/quant_linear_x16.c's tm_x16_weight: a weight in the interleaved layout."""
    _fields_ = [("q", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p), ("K", ctypes.c_int64),
                ("N", ctypes.c_int64), ("G", ctypes.c_int64), ("kind", ctypes.c_int32), ("d_f32", ctypes.c_int32),
                ("m_f32", ctypes.c_int32), ("amx_from_rows", ctypes.c_int32), ("symmetric", ctypes.c_int32)]


def x16_register_rows() -> int:
    """Output rows per register of this host's interleaved int4 / int8 kernel: 16 (AVX-512 VNNI), 8 (AVX2) or 0
    (no such build)."""
    lib = library()
    return 0 if lib is None else int(lib.tm_x16_register_rows())


def x16_available() -> bool:
    """Whether this host's build has the interleaved int4 / int8 kernel (AVX-512 VNNI or AVX2)."""
    return x16_register_rows() > 0


def amx_available() -> bool:
    """Whether this host's build has the AMX tile kernel of quant_linear_x16.c and Linux lets this process use the
    tiles."""
    lib = library()
    return lib is not None and bool(lib.tm_amx_available())


def library(cache_dir: str = DEFAULT_CACHE_DIR) -> ctypes.CDLL | None:
    """The built library (built once per process and cached on disk), or None where it cannot be built."""
    with _lock:
        if cache_dir not in _loaded:
            try:
                _loaded[cache_dir] = _build(Path(cache_dir).expanduser())
            except OSError as exc:
                log.warning("CPU kernels: cannot build or load (%s): the PyTorch references run instead", exc)
                _loaded[cache_dir] = None
        return _loaded[cache_dir]
