"""Build and load ``_bn_silu.c``: compiler discovery, flags, a cache per CPU, OpenMP linking, ctypes bindings.

The C file is compiled on first use with the system C compiler (``$CC``, else ``cc``; ``-O3 -march=native
-fno-trapping-math -fopenmp``) into ``$XDG_CACHE_HOME/yolo5l/kernels`` (about a second), keyed by the source, the
flags, the compiler, the CPU and the OpenMP runtime it links. :func:`load_library` returns None, with the reason
logged once, where that fails (no compiler, a compiler error); callers then use PyTorch's ops.

OpenMP: ``cc -fopenmp`` links the compiler's own runtime (``-lgomp``). Where torch ships its own copy under another
soname (older wheels: ``libgomp-<hash>.so.1``; builds on Intel's or LLVM's runtime) that maps a second runtime
beside torch's, with a second thread pool whose idle threads spin against torch's. So the kernels are compiled with
``-fopenmp`` but linked against the runtime torch's own ops run on, found with ``dladdr`` on torch's
``omp_get_max_threads``: the dynamic loader then reuses the copy already loaded. Where that runtime cannot be
linked (a compiler whose OpenMP ABI differs, such as clang's ``__kmpc_*`` against libgomp) the kernels are built
without OpenMP and run on one thread, with a warning.
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

import torch

__all__ = ["CFLAGS", "DTYPES", "SOURCE", "BuildError", "compile_library", "find_compiler", "load_library"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("_bn_silu.c")
CFLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fPIC")
DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}  # storage types the C file instantiates, by suffix

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None  # why the library is unavailable, once tried


class BuildError(RuntimeError):
    """No compiler, or the compiler failed on the source."""


def find_compiler() -> str:
    """The C compiler: ``$CC``, else ``cc``, as found on PATH.

    Raises:
        BuildError: Neither is on PATH.
    """
    cc = os.environ.get("CC") or "cc"
    path = shutil.which(cc)
    if path is None:
        raise BuildError(f"no C compiler ({cc!r} not on PATH; set CC)")
    return path


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def openmp_runtime() -> Path | None:
    """The OpenMP runtime library torch's own CPU ops run on, or None (torch without OpenMP, or not found).

    Asks the dynamic loader rather than listing ``torch/lib``: torch may use a system runtime, and another package
    may have mapped a different one into the process already.
    """
    if not torch.backends.openmp.is_available():
        return None
    try:
        lib_dir = Path(torch.__file__).parent / "lib"
        torch_cpu = next(p for p in sorted(lib_dir.glob("libtorch_cpu.*")) if p.suffix in (".so", ".dylib"))
        # Already loaded by `import torch`: RTLD_NOLOAD only returns its handle. dlsym on that handle searches the
        # library and then its dependencies, so it finds the runtime torch itself was linked against.
        handle = ctypes.CDLL(str(torch_cpu), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        addr = ctypes.cast(handle.omp_get_max_threads, ctypes.c_void_p).value
        dladdr = ctypes.CDLL(None).dladdr
        dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        info = _DlInfo()
        if not dladdr(addr, ctypes.byref(info)) or not info.dli_fname:
            return None
        path = Path(os.fsdecode(info.dli_fname))
    except (OSError, AttributeError, StopIteration):
        return None
    return path if path.is_absolute() and path.exists() else None


def _cpu_id() -> str:
    """What -march=native depends on: the CPU's model and flags (Linux), else the platform's description."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise BuildError(f"{cmd[0]} failed on {SOURCE}:\n{proc.stderr.strip()[-2000:]}")


def _commands(cc: str, src: Path, tmp: Path, out: Path, flags: tuple[str, ...], omp: Path | None) -> list[list[str]]:
    """The compiler invocations that build ``out`` with OpenMP, linked against ``omp`` where given."""
    if omp is None:
        return [[cc, *flags, "-fopenmp", "-shared", str(src), "-o", str(out)]]
    obj = str(tmp / "bn_silu.o")
    # Compile and link apart: at the link step `-fopenmp` would add the compiler's `-lgomp`. `-z defs` turns a
    # symbol the given runtime lacks into a link error here instead of an undefined symbol at load time.
    return [
        [cc, *flags, "-fopenmp", "-c", str(src), "-o", obj],
        [cc, *flags, "-shared", obj, str(omp), f"-Wl,-rpath,{omp.parent}", "-Wl,-z,defs", "-lm", "-o", str(out)],
    ]


def compile_library(cc: str, out: Path, flags: tuple[str, ...] = CFLAGS, omp: Path | None = None) -> None:
    """Compile :data:`SOURCE` into the shared library ``out``, replacing it atomically.

    Args:
        cc: The C compiler.
        out: Where the library goes.
        flags: Compiler flags (without OpenMP's, which this adds).
        omp: The OpenMP runtime to link (:func:`openmp_runtime`); None links the compiler's own.

    Raises:
        BuildError: The compiler failed with OpenMP and without it.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as d:
        tmp = Path(d)
        so = tmp / "bn_silu.so"
        try:
            for cmd in _commands(cc, SOURCE, tmp, so, flags, omp):
                _run(cmd)
        except BuildError as e:
            # One thread beats no kernel; the pragmas are ignored and bn_silu_openmp() tells the loader.
            log.debug("OpenMP build failed, building without OpenMP: %s", e)
            _run([cc, *flags, "-Wno-unknown-pragmas", "-shared", str(SOURCE), "-o", str(so)])
        os.replace(so, out)  # atomic: concurrent ranks compile side by side, one file wins


def _bind(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for sfx in DTYPES.values():
        getattr(lib, f"bn_stats_{sfx}").argtypes = [p, i64, i64, p, p, i32]
        getattr(lib, f"bn_silu_fwd_{sfx}").argtypes = [p, p, i64, i64, p, p, p, p, i32]
        getattr(lib, f"bn_silu_bwd_{sfx}").argtypes = [p, p, p, i64, i64, p, p, p, p, p, p, i32]
        for name in ("bn_stats", "bn_silu_fwd", "bn_silu_bwd"):
            getattr(lib, f"{name}_{sfx}").restype = i32
    lib.bn_silu_openmp.argtypes = []
    lib.bn_silu_openmp.restype = i32


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(root) / "yolo5l" / "kernels"


def load_library() -> ctypes.CDLL | None:
    """The compiled kernels (compiled and cached on first call), or None with the reason logged once."""
    global _lib, _error
    if _lib is not None or _error is not None:
        return _lib
    with _lock:
        if _lib is not None or _error is not None:
            return _lib
        try:
            cc = find_compiler()
            omp = openmp_runtime()
            version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
            key = hashlib.sha256(
                "\0".join([SOURCE.read_text(), " ".join(CFLAGS), str(omp), version, _cpu_id()]).encode()
            ).hexdigest()[:16]
            path = _cache_dir() / f"bn_silu-{key}.so"
            if not path.exists():
                compile_library(cc, path, CFLAGS, omp)
            lib = ctypes.CDLL(str(path))
            _bind(lib)
            if not lib.bn_silu_openmp():
                log.warning("fused BatchNorm+SiLU kernel built without OpenMP (%s): it runs on one thread", cc)
            _lib = lib
        except (OSError, BuildError, subprocess.SubprocessError) as e:
            _error = str(e)
            log.warning("fused BatchNorm+SiLU kernel unavailable, using PyTorch ops: %s", _error)
    return _lib


def error() -> str | None:
    """Why :func:`load_library` returned None, once it has been called; else None."""
    return _error
