"""A compile worker of ``precompile``: reads (module, kernel name, specialisation, target, installation hash
or None) jobs from stdin, compiles each into Triton's on-disk cache and answers None or the error's text.
Run as a script: it loads the kernel modules without the convt3d package, so that a worker starts with
Triton alone (no PyTorch, no CUDA context)."""
import functools
import importlib
import json
import os
import pickle
import struct
import sys
import types

_PACKAGE = "convt3d.engines.triton"


def _load(module: str):
    """Import a kernel module under its package name, its parent packages stubbed (no __init__ run)."""
    here = os.path.dirname(os.path.abspath(__file__))
    parts = _PACKAGE.split(".")
    for i in range(len(parts)):
        name = ".".join(parts[:i + 1])
        if name not in sys.modules:
            stub = types.ModuleType(name)
            stub.__path__ = [os.path.join(here, *[".."] * (len(parts) - 1 - i))]
            sys.modules[name] = stub
    return importlib.import_module(module)


def write_message(stream, obj) -> None:
    """One message: its pickle after the pickle's length as 8 bytes."""
    data = pickle.dumps(obj)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def read_message(stream):
    """The next message of ``stream``; EOFError where the other side has closed it."""
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("the other side closed the pipe")
    return pickle.loads(stream.read(struct.unpack("<Q", head)[0]))


def use_installation_key(key: str) -> None:
    """Make ``key`` Triton's installation hash here, replacing ``cache.triton_key`` as Triton's compile pool does."""
    from triton.runtime import cache

    if getattr(cache.triton_key, "installation_key", None) != key:
        kept = functools.lru_cache()(lambda: key)
        kept.installation_key = key
        cache.triton_key = kept


def _tuples(v):
    return tuple(_tuples(e) for e in v) if isinstance(v, list) else v


def compile_one(module: str, name: str, spec: str, target: tuple, key: str | None = None) -> None:
    """Compile one specialisation as Triton's launch would, from its cache hook's JSON (``key``: the parent's hash)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    if key is not None:
        use_installation_key(key)

    fn = getattr(_load(module), name)
    d = json.loads(spec)

    def constant(v):
        if isinstance(v, str) and tl.dtype.is_dtype(v):
            return tl.dtype(v)
        if isinstance(v, dict) and "constexpr" in v:
            return tl.constexpr(v["constexpr"])
        return _tuples(v)

    constexprs = {tuple(k): constant(v) for k, v in zip(d["constant_keys"], d["constant_vals"])}
    attrs = dict(zip(map(tuple, d["attrs_keys"]), d["attrs_vals"]))
    signature = {k: _tuples(v) for k, v in d["signature"].items()}
    options = {k: _tuples(v) for k, v in d["options"].items()}
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    else:
        from triton.compiler import ASTSource as source
    src = source(fn, signature, constexprs, attrs)
    kernel = triton.compile(src, target=GPUTarget(*target), options=options)
    _build_launcher(src, kernel)


def _build_launcher(src, kernel) -> None:
    """Build the C launcher of the kernel's signature into the cache too, where this Triton version makes one
    per signature at the first launch (newer versions have one generic launcher and no ``make_launcher``)."""
    try:
        from triton.backends.nvidia import driver as nv
        make_launcher = nv.make_launcher
    except (ImportError, AttributeError):
        return
    index = lambda k: (src.fn.arg_names.index(k),) if isinstance(k, str) else k  # noqa: E731
    constants = {index(k): v for k, v in getattr(src, "constants", {}).items()}
    code = make_launcher(constants, dict(src.signature), getattr(kernel.metadata, "tensordesc_meta", None))
    nv.compile_module_from_src(src=code, name="__triton_launcher", library_dirs=nv.library_dirs(),
                               include_dirs=nv.include_dirs, libraries=nv.libraries)


def main() -> None:
    # The protocol owns the original stdout; anything else written to fd 1 (compiler messages) goes to stderr.
    inp, out = sys.stdin.buffer, os.fdopen(os.dup(1), "wb", buffering=0)  # unbuffered: nothing left to flush at exit
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    while True:
        try:
            job = read_message(inp)
        except EOFError:
            return
        try:
            compile_one(*job)
            answer = None
        except Exception as exc:  # noqa: BLE001 -- reported to the parent, which compiles it itself
            answer = f"{type(exc).__name__}: {exc}"[:300]
        try:
            write_message(out, answer)
        except OSError:  # the parent exited while this job compiled (a background compile at exit)
            return


if __name__ == "__main__":
    main()
