"""House budgets of the hand-written code: lines, long files, timing figures, private cross-imports.

Measures the package (src/convt3d, Python and CUDA), the bench, the exporter and this tools folder:
total lines, Python files over 700 lines, timing figures (a number followed by us/µs/ms/TB/s/GB/s/
TFLOP/s) in comments and docstrings per 1,000 lines, and private names imported from another module.
No GPU needed.

    python tools/house_budgets.py [REPO_ROOT] [-v]     # -v lists the private imports
"""
import ast, re, sys
from pathlib import Path
root = Path(sys.argv[1] if len(sys.argv) > 1 else '.')
files = [p for p in (root / 'src').rglob('*') if p.suffix in ('.py', '.cu', '.cuh', '.h') and 'egg-info' not in str(p)]
for d in ('tools', 'scripts'):
    files += [p for p in (root / d).glob('*') if p.is_file()]
FIG = re.compile(r"\d(?:[\d.,]*)\s?(?:µs|us|ms|TB/s|GB/s|TFLOP/s)\b")
total = figs = 0; big = []; priv = []
for p in sorted(files):
    text = p.read_text(errors='replace'); n = text.count('\n'); total += n
    if n > 700 and p.suffix == '.py': big.append((n, str(p.relative_to(root))))
    if p.suffix == '.py':
        tree = ast.parse(text)
        # Figures in comments, then in docstrings.
        figs += sum(len(FIG.findall(line.split('#', 1)[1])) for line in text.splitlines() if '#' in line)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    figs += len(FIG.findall(doc))
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if a.name.startswith('_') and not a.name.startswith('__') and (node.level > 0 or (node.module or '').startswith('convt3d')):
                        priv.append(f"{p.relative_to(root)}: from {'.'*node.level}{node.module or ''} import {a.name}")
    else:
        figs += len(FIG.findall('\n'.join(l for l in text.splitlines() if '//' in l or '*' in l)))
print(f"hand-written lines: {total} in {len(files)} files; timing figures {figs} ({figs*1000/total:.2f} per 1,000 lines)")
print("python files over 700 lines:", big)
print(f"private names imported from other modules: {len(priv)}")
if '-v' in sys.argv: print('\n'.join(priv))
