"""House budgets of the hand-written code (src/convt3d, Python and CUDA, and this tools folder), no GPU:
total lines, Python files over 700 lines, timing figures (a number followed by us/µs/ms/TB/s/GB/s/TFLOP/s)
in comments and docstrings per 1,000 lines, and private names imported from another subpackage (and,
for the record, within one). The hand-kept KernelBench CUDA entry is counted on a line of its own.

    python tools/house_budgets.py [REPO_ROOT] [-v]     # -v lists the private imports
"""
import ast
import re
import sys
from pathlib import Path

if '-h' in sys.argv or '--help' in sys.argv:
    print(__doc__)
    sys.exit(0)
root = Path(next((a for a in sys.argv[1:] if not a.startswith('-')), '.'))
pkg = root / 'src'
files = [p for p in pkg.rglob('*') if p.suffix in ('.py', '.cu', '.cuh', '.h') and 'egg-info' not in str(p)]
files += [p for p in (root / 'tools').glob('*') if p.is_file()]
FIG = re.compile(r"\d(?:[\d.,]*)\s?(?:µs|us|ms|TB/s|GB/s|TFLOP/s)\b")
total = figs = 0
big, across, within = [], [], []
for p in sorted(files):
    text = p.read_text(errors='replace')
    n = text.count('\n')
    total += n
    if n > 700 and p.suffix == '.py':
        big.append((n, str(p.relative_to(root))))
    if p.suffix != '.py':
        figs += len(FIG.findall('\n'.join(l for l in text.splitlines() if '//' in l or '*' in l)))
        continue
    tree = ast.parse(text)
    figs += sum(len(FIG.findall(line.split('#', 1)[1])) for line in text.splitlines() if '#' in line)
    mod = p.relative_to(pkg).with_suffix('').parts if pkg in p.parents else ('tools', p.stem)
    here = mod[:-1]  # the package a relative import starts from, for a module and an __init__ alike
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                figs += len(FIG.findall(doc))
        if isinstance(node, ast.ImportFrom):
            if node.level:
                target = list(here[:len(here) - node.level + 1]) + (node.module.split('.') if node.module else [])
            elif (node.module or '').startswith('convt3d'):
                target = node.module.split('.')
            else:
                continue
            for a in node.names:
                if a.name.startswith('_') and not a.name.startswith('__'):
                    line = f"{p.relative_to(root)}: {'.'.join(target)}.{a.name}"
                    (within if here in (tuple(target), tuple(target[:-1])) else across).append(line)
entry = sorted((root / 'kernelbench').glob('*_cuda.py'))
print(f"hand-written lines: {total} in {len(files)} files; timing figures {figs} ({figs*1000/total:.2f} per 1,000 lines)")
for e in entry:
    print(f"hand-kept KernelBench CUDA entry: {e.name}, {e.read_text().count(chr(10))} lines")
print("python files over 700 lines:", big)
print(f"private names imported across subpackages: {len(across)} (within one subpackage: {len(within)})")
if '-v' in sys.argv:
    print('\n'.join(across + within))
