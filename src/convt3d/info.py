"""``convt3d info`` (what this machine can run: GPU, versions, engines, caches) and
``convt3d cache show|clear`` (convt3d's cache of measurements, and Triton's)."""
from __future__ import annotations

import argparse
import json
import platform
import shutil
from pathlib import Path

import torch

from .dispatch import cache
from .version import __version__

__all__ = ["machine", "main", "cache_main"]


def _count(paths) -> tuple[int, int]:
    """(files, bytes) among ``paths``."""
    files = [p for p in paths if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def _amount(files: int, size: int) -> str:
    return f"{files} file{'' if files == 1 else 's'}, {size:,} bytes"


def _triton_cache() -> tuple[Path, int, int]:
    """(directory, files, bytes) of Triton's compiled-kernel cache."""
    import triton

    d = Path(triton.knobs.cache.dir)
    return (d, *_count(d.rglob("*"))) if d.is_dir() else (d, 0, 0)


def _engines(device: torch.device) -> dict[str, str | None]:
    """Per registered engine, None where it can run on this machine's device, else why not (its devices, its check)."""
    from .dispatch.registry import ENGINES
    from .engines.triton.sites import interpreter_active

    out = {}
    for name, engine in ENGINES.items():
        why = None
        if engine.devices is not None and device.type not in engine.devices:
            why = f"needs a {' or '.join(d.upper() for d in engine.devices)} device"
        elif hasattr(engine, "input_reason"):
            why = engine.input_reason(torch.empty(0, device=device))
        if why is None and name == "triton" and device.type == "cpu" and not interpreter_active():
            why = "GPU kernels need a CUDA device (the interpreter runs with TRITON_INTERPRET=1)"
        out[name] = why
    return out


def _first_calls() -> str:
    """How a new signature's first call treats candidates still compiling, and who compiles them."""
    from .dispatch import first_call
    from .engines.triton import precompile

    try:
        mode = first_call.mode()
    except ValueError as exc:
        return str(exc)
    workers = precompile.worker_count()
    how = (f"{workers} compile worker process{'es' if workers > 1 else ''}" if workers
           else "no compile workers (CONVT3D_COMPILE_WORKERS=0)")
    if mode == "background" and workers:
        return f"background ({first_call.ENV}): PyTorch's call runs while the candidates compile in {how}"
    return f"wait: the first call compiles and times every candidate ({how})"


def machine() -> dict:
    """What ``convt3d info`` reports, as plain data."""
    import triton

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    files, size = _count(cache.owned_files())
    tdir, tfiles, tsize = _triton_cache()
    return {
        "convt3d": __version__,
        "gpu": {"name": torch.cuda.get_device_name(device),
                "capability": "{}.{}".format(*torch.cuda.get_device_capability(device))} if cuda else None,
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                     "triton": triton.__version__, "cudnn": torch.backends.cudnn.version()},
        "engines": _engines(device),
        "first_calls": _first_calls(),
        "cache": {"dir": str(cache.cache_dir()), "files": files, "bytes": size},
        "triton_cache": {"dir": str(tdir), "files": tfiles, "bytes": tsize},
    }


def _text(m: dict) -> str:
    v, gpu = m["versions"], m["gpu"]
    out = [f"convt3d {m['convt3d']}",
           f"GPU: {gpu['name']} (compute capability {gpu['capability']})" if gpu else "GPU: no CUDA device",
           f"versions: python {v['python']}, torch {v['torch']} (CUDA {v['torch_cuda'] or 'none'}), "
           f"triton {v['triton']}, cuDNN {v['cudnn'] or 'none'}",
           "engines (can they run on this machine?):"]
    out += [f"  {name:<10} {'yes' if why is None else 'no: ' + why}" for name, why in m["engines"].items()]
    if not gpu:
        interpreter = "; Triton's interpreter is on (TRITON_INTERPRET=1)" if m["engines"].get("triton") is None else ""
        out.append(f"  (on CPU tensors 'auto' runs PyTorch's call{interpreter})")
    out.append(f"first calls: {m['first_calls']}")
    c, t = m["cache"], m["triton_cache"]
    out.append(f"convt3d cache: {c['dir']} ({_amount(c['files'], c['bytes'])}; 'convt3d cache show' lists them)")
    out.append(f"Triton cache: {t['dir']} ({_amount(t['files'], t['bytes'])})")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """``convt3d info``: this machine's GPU, versions, engines and caches."""
    parser = argparse.ArgumentParser(prog="convt3d info", description="What convt3d can run on this machine: "
                                     "GPU, versions, engines and the caches.")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    m = machine()
    print(json.dumps(m, indent=1) if args.json else _text(m))
    return 0


def cache_main(argv: list[str] | None = None) -> int:
    """``convt3d cache show|clear``: convt3d's cache files, and Triton's cache folder."""
    parser = argparse.ArgumentParser(prog="convt3d cache", description="Show or clear convt3d's cache (measured "
                                     f"decisions, tuned tiles) in ${cache.ENV_DIR}, by default "
                                     "~/.cache/convt3d. Measurements are redone as calls need them.")
    parser.add_argument("action", nargs="?", choices=("show", "clear"), default="show")
    parser.add_argument("--triton", action="store_true", help="clear also empties Triton's compiled-kernel cache "
                        "($TRITON_CACHE_DIR, by default ~/.triton/cache)")
    args = parser.parse_args(argv)
    d, files = cache.cache_dir(), cache.owned_files()
    n, size = _count(files)
    if args.action == "show":
        state = _amount(n, size) if files else "empty" if d.is_dir() else "not created yet"
        print(f"convt3d cache: {d} ({state})")
        for f in files:
            line = f"  {f.relative_to(d)}  {f.stat().st_size:,} bytes"
            if f.parent == d and f.suffix == ".json":
                counts, problem = cache.file_summary(f)
                line += (": " + ", ".join(f"{s} {k}" for s, k in counts.items())) if counts else ""
                line += f" ({problem}; ignored and rewritten at the next save)" if problem else ""
            print(line)
        tdir, tn, tsize = _triton_cache()
        print(f"Triton cache: {tdir} ({_amount(tn, tsize)}; 'clear --triton' empties it)")
        return 0
    for f in files:
        f.unlink(missing_ok=True)
    if (d / "build").is_dir() and not any((d / "build").iterdir()):
        (d / "build").rmdir()
    names = ", ".join(str(f.relative_to(d)) for f in files)
    print(f"convt3d cache: removed {_amount(n, size)} from {d}" + (f": {names}" if names else ""))
    if args.triton:
        tdir, tn, tsize = _triton_cache()
        for entry in tdir.iterdir() if tdir.is_dir() else ():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        print(f"Triton cache: removed {_amount(tn, tsize)} from {tdir}")
    return 0
