"""A pickle reader that runs no code: ultralytics/yolov5 ``.pt`` files are full pickles of their model classes.

``restricted_pickle`` is a module-like object for ``torch.load(pickle_module=...)``: its unpickler admits only an
explicit list of globals (torch's tensor rebuilders, ``OrderedDict``, ``set``, pure paths, numpy arrays, dtypes and
scalars) and turns the pickled module classes (``models.common.Conv``, ``torch.nn.Conv2d``, ...) and ``opt``'s
``argparse.Namespace`` into inert ``StandIn`` objects that only hold their ``__dict__``. Anything else raises
:class:`UnsafeCheckpointError`, naming the global; nothing it refers to is imported or called.

The numpy globals are those of the arrays and scalars in an unstripped training checkpoint (``best_fitness``, the
optimizer's learning rates): ``_reconstruct`` makes an empty array of an admitted class (only ``numpy.ndarray``) and
``ndarray.__setstate__`` fills it from bytes or, for object arrays, from objects this same unpickler made.
"""

from __future__ import annotations

import _compat_pickle
import codecs
import collections
import os
import pathlib
import pickle
import types
from typing import Any

import torch

__all__ = ["StandIn", "UnsafeCheckpointError", "restricted_pickle"]


class UnsafeCheckpointError(pickle.UnpicklingError, ValueError):
    """A pickle asked for a global outside the allow-list; nothing it referred to was called.

    Also a ``ValueError``, so callers that report bad input files by catching ``ValueError`` report this too.

    Attributes:
        module: Module of the refused global.
        name: Name of the refused global.
    """

    def __init__(self, module: str, name: str, path: str | os.PathLike[str] | None = None) -> None:
        self.module, self.name, self.path = module, name, path
        where = f"{os.fspath(path)}: " if path is not None else ""
        super().__init__(
            f"{where}refused to unpickle global '{module}.{name}': it is not part of an ultralytics/yolov5 "
            "checkpoint, and loading it could run code. Only load files you trust; yolo5l reads yolov5 v6-v7 "
            "DetectionModel checkpoints and yolo5l checkpoints."
        )


class StandIn:
    """Inert stand-in for a pickled module object: pickle's BUILD fills ``__dict__``, nothing else runs."""

    pickled_as = ""
    # torch's legacy (non-zip) reader compares saved class sources and, with dump_patches, writes .patch files.
    dump_patches = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # REDUCE of old protocols calls cls(*args)
        pass

    def __repr__(self) -> str:
        return f"<stand-in for {self.pickled_as}>"


# Module classes an ultralytics/yolov5 v6-v7 pickle refers to: the blocks its model yamls can name (v5-era ones in
# models.experimental too), activations, and the v7 segmentation/classification models (so that such files fail
# later with a clear architecture message).
_COMMON = (
    "Conv", "C3", "Bottleneck", "SPPF", "Concat", "Focus", "SPP", "Proto", "Classify", "DWConv", "DWConvTranspose2d",
    "TransformerLayer", "TransformerBlock", "BottleneckCSP", "CrossConv", "C3x", "C3TR", "C3SPP", "C3Ghost",
    "GhostConv", "GhostBottleneck", "Contract", "Expand",
)  # fmt: skip
_EXPERIMENTAL = ("MixConv2d", "CrossConv", "GhostConv", "GhostBottleneck", "Sum")
_YOLO = ("Detect", "DetectionModel", "Model", "Segment", "SegmentationModel", "ClassificationModel")
_MODULE_CLASSES: dict[str, tuple[str, ...]] = {
    **{f"{pkg}models.{mod}": names for pkg in ("", "yolov5.")  # the PyPI `yolov5` package pickles as yolov5.models
       for mod, names in (("common", _COMMON), ("experimental", _EXPERIMENTAL), ("yolo", _YOLO))},
    "torch.nn.modules.activation": (
        "SiLU", "ReLU", "ReLU6", "LeakyReLU", "Hardswish", "Mish", "GELU", "ELU", "Sigmoid", "Tanh",
        "MultiheadAttention",
    ),
    "torch.nn.modules.batchnorm": ("BatchNorm2d",),
    "torch.nn.modules.container": ("ModuleList", "Sequential"),
    "torch.nn.modules.conv": ("Conv2d", "ConvTranspose2d"),
    "torch.nn.modules.linear": ("Identity", "Linear", "NonDynamicallyQuantizableLinear"),
    "torch.nn.modules.padding": ("ZeroPad2d",),
    "torch.nn.modules.pooling": ("MaxPool2d",),
    "torch.nn.modules.upsampling": ("Upsample",),
    "argparse": ("Namespace",),  # train.py's `opt` in files that pickled the Namespace itself
}  # fmt: skip
_STAND_INS: dict[tuple[str, str], type[StandIn]] = {
    (mod, name): type(name, (StandIn,), {"pickled_as": f"{mod}.{name}", "__module__": __name__})
    for mod, names in _MODULE_CLASSES.items()
    for name in names
}
_STORAGES = (
    "FloatStorage", "HalfStorage", "DoubleStorage", "BFloat16Storage", "LongStorage", "IntStorage", "ShortStorage",
    "CharStorage", "ByteStorage", "BoolStorage",
)  # fmt: skip
_DTYPES = ("float16", "float32", "float64", "bfloat16", "int64", "int32", "uint8", "bool")


_NUMPY_GLOBALS = {
    ("numpy", "dtype"), ("numpy", "ndarray"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),  # numpy 2 renamed numpy.core
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
}  # fmt: skip


def _numpy_global(name: str) -> Any:
    import numpy as np

    if name in ("dtype", "ndarray"):
        return getattr(np, name)
    core = getattr(np, "_core", None) or np.core  # numpy 2 moved numpy.core to numpy._core
    return getattr(core.multiarray, name)  # scalar or _reconstruct


def _allowed_global(module: str, name: str) -> Any:
    """Resolve one admitted global, or raise :class:`UnsafeCheckpointError`."""
    key = (module, name)
    if key in _STAND_INS:
        return _STAND_INS[key]
    if key == ("collections", "OrderedDict"):
        return collections.OrderedDict
    if module == "builtins" and name in ("set", "frozenset"):
        return {"set": set, "frozenset": frozenset}[name]
    if module in ("pathlib", "pathlib._local") and name in ("PosixPath", "PurePosixPath"):
        return pathlib.PurePosixPath  # pure paths: constructible on any OS, never touch the file system
    if module in ("pathlib", "pathlib._local") and name in ("WindowsPath", "PureWindowsPath"):
        return pathlib.PureWindowsPath
    if module == "torch._utils" and name in (
        "_rebuild_tensor",
        "_rebuild_tensor_v2",
        "_rebuild_tensor_v3",
        "_rebuild_parameter",
        "_rebuild_parameter_with_state",
    ):
        return getattr(torch._utils, name)
    if module == "torch" and (name in _STORAGES or name in _DTYPES):
        return getattr(torch, name)
    if key == ("_codecs", "encode"):  # protocol 2 pickles bytes (e.g. a numpy scalar's payload) as encode(str)
        return codecs.encode
    if key in _NUMPY_GLOBALS:
        return _numpy_global(name)
    raise UnsafeCheckpointError(module, name)


class _RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` admits only :func:`_allowed_global`'s list.

    Every way a pickle names a global (GLOBAL, STACK_GLOBAL, INST, OBJ, EXT*) goes through ``find_class``, so
    nothing outside the list is ever imported or called. torch's ``persistent_load`` (set on the instance by
    ``torch.load``) still supplies the tensor storages of zip-format files.
    """

    def find_class(self, module: str, name: str) -> Any:
        # Protocol-2 pickles spell Python 3 names the Python 2 way (`__builtin__ set`); map them as pickle does.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        return _allowed_global(module, name)


def _restricted_load(file: Any, **kwargs: Any) -> Any:
    return _RestrictedUnpickler(file, **kwargs).load()


def _restricted_loads(data: bytes, **kwargs: Any) -> Any:
    import io

    return _RestrictedUnpickler(io.BytesIO(data), **kwargs).load()


# A module-like object for ``torch.load(pickle_module=...)``: torch subclasses ``Unpickler`` (its wrapper's
# ``find_class`` maps storage names, then defers to ours) and calls ``load`` for the legacy format's headers.
restricted_pickle = types.ModuleType("yolo5l.io.safe_pickle.restricted_pickle")
restricted_pickle.Unpickler = _RestrictedUnpickler  # type: ignore[attr-defined]
restricted_pickle.load = _restricted_load  # type: ignore[attr-defined]
restricted_pickle.loads = _restricted_loads  # type: ignore[attr-defined]
restricted_pickle.UnpicklingError = pickle.UnpicklingError  # type: ignore[attr-defined]
