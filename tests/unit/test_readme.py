"""The README's examples as a newcomer runs them on a CPU-only machine: the quick start (its first
```python block, with the CUDA device replaced by the CPU) and each ``convt3d ...`` shell example
that a CPU can run, through ``python -m convt3d`` with a private cache. The examples are read from
README.md, so this test follows the README as it changes."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from convt3d import cli

README = Path(__file__).resolve().parents[2] / "README.md"

# Both tests run convt3d as CI does, with Triton's interpreter (the suite's conftest sets it on a
# machine without CUDA); on a GPU machine the same examples would time kernels instead.
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the README's examples as on a CPU-only machine: needs TRITON_INTERPRET=1")

# Commands whose README examples are not run here, and why.
NOT_ON_CPU = {
    "kernelbench": "evaluates the seven KernelBench files at full size, about a minute per precision through "
                   "the interpreter (tests/kernelbench runs each file at a reduced size, and the evaluation on a GPU)",
    "export-kernelbench": "rewrites the checkout's kernelbench/ files (tests/kernelbench checks them with --check)",
}
# Commands that run for minutes through the interpreter: only their examples in a ```bash block,
# the ones a newcomer copies, run here; the prose mentions them with other options.
SLOW_ON_CPU = {"bench": "checks every bench suite's kernels through the interpreter"}
# Commands that cannot run without options: the CLI table names them bare.
NEEDS_OPTIONS = {"explain": "needs --input and --weight; the README's example with them runs"}


def _quick_start() -> str:
    m = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert m, "README.md has no ```python block"
    return m.group(1)


def _examples() -> dict[str, bool]:
    """Each distinct ``convt3d ...`` command of the README -> whether a ```bash block holds it.
    Inline code spans count too; a table's ``a\\|b`` is two commands; placeholders (``<command>``)
    are not commands."""
    text = README.read_text()
    found: dict[str, bool] = {}

    def add(span: str, fenced: bool) -> None:
        span = span.strip()
        if "<" in span:
            return
        words = span.split()
        alternatives = [[w] if "\\|" not in w else w.split("\\|") for w in words]
        variants = [[]]
        for alts in alternatives:
            variants = [v + [a] for v in variants for a in alts]
        for v in variants:
            cmd = " ".join(v)
            found[cmd] = found.get(cmd, False) or fenced

    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            m = re.search(r"(?:^|&&|;)\s*(convt3d\s[^#&;]*)", line)
            if m:
                add(m.group(1), True)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`(convt3d\s[^`]+)`", prose):
        add(span, False)
    return found


def _why_not_run(cmd: str, fenced: bool) -> str | None:
    words = cmd.split()[1:]
    name = words[0]
    if name in NOT_ON_CPU:
        return NOT_ON_CPU[name]
    if name in SLOW_ON_CPU and not fenced:
        return f"{SLOW_ON_CPU[name]}; its example in a ```bash block runs"
    if len(words) == 1 and name in NEEDS_OPTIONS:
        return NEEDS_OPTIONS[name]
    return None


def _example_params():
    params = []
    for cmd, fenced in _examples().items():
        why = _why_not_run(cmd, fenced)
        marks = [pytest.mark.skip(reason=why)] if why else []
        ident = "-".join(w.lstrip("-") for w in cmd.split()[1:])
        params.append(pytest.param(cmd, id=ident, marks=marks))
    return params


@needs_interpreter
def test_quick_start_runs_on_the_cpu():
    source = _quick_start()
    assert 'device="cuda"' in source and ".cuda()" in source  # else the replacements below miss
    source = source.replace('device="cuda"', 'device="cpu"').replace(".cuda()", ".cpu()")
    import convt3d

    ns: dict = {}
    exec(compile(source, f"{README}:quick start", "exec"), ns)
    x, w, b, model, y = ns["x"], ns["w"], ns["b"], ns["model"], ns["y"]
    assert tuple(y.shape) == tuple(F.conv_transpose3d(x, w, b, stride=2, padding=1).shape)
    # patch() swapped the layer in place; the model's output is its ReLU'd transposed convolution.
    conv = model[0]
    assert isinstance(conv, convt3d.ConvTranspose3d)
    with torch.no_grad():
        expected = F.relu(F.conv_transpose3d(x, conv.weight, conv.bias, stride=2, padding=1))
    torch.testing.assert_close(y.detach(), expected)


def test_readme_names_only_commands_that_exist():
    examples = _examples()
    assert examples, "README.md has no convt3d shell example"
    known = set(cli.COMMANDS) | {"--version", "-V", "--help", "-h"}
    unknown = sorted(cmd for cmd in examples if cmd.split()[1] not in known)
    assert not unknown, f"README.md names commands convt3d does not have: {unknown}"
    stale = set(NOT_ON_CPU) | set(SLOW_ON_CPU) | set(NEEDS_OPTIONS)
    assert stale <= {cmd.split()[1] for cmd in examples}, "a command listed here is no longer in README.md"


@needs_interpreter
@pytest.mark.parametrize("cmd", _example_params())
def test_shell_example_runs_on_the_cpu(cmd, tmp_path):
    env = dict(os.environ, CONVT3D_CACHE_DIR=str(tmp_path / "cache"), TRITON_CACHE_DIR=str(tmp_path / "triton"))
    done = subprocess.run([sys.executable, "-m", *cmd.split()], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=900)
    assert done.returncode == 0, f"{cmd}: exit status {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
