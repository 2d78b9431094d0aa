"""Tree-shaking of the package source for the KernelBench files: every top-level definition an entry reaches,
with the comments above it; relative imports become nothing, an alias or a ``types.SimpleNamespace``, absolute
ones are hoisted. The modules share one namespace, so two reached definitions of one name are refused."""
from __future__ import annotations

import ast
import symtable
import sys
from dataclasses import dataclass, field
from typing import Callable


class ExportError(RuntimeError):
    """The package source cannot be exported as it is (the message says which line and why)."""


class ShakeError(ExportError):
    """The source cannot be shaken as it is (the message names the module and line)."""


@dataclass
class Line:
    text: str
    origin: str  # "convt3d/<module>:<line>" or "generated"


@dataclass
class _Module:
    path: str
    source: str
    tree: ast.Module
    table: symtable.SymbolTable
    # name -> ("stmt", i: tree.body[i]) | ("from", module path, name) | ("alias", module path) | ("ext", import, node)
    bindings: dict[str, tuple] = field(default_factory=dict)
    imports: list[str] = field(default_factory=list)  # the package modules it imports relatively, in order


def _target_names(target: ast.expr) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for e in target.elts for n in _target_names(e)]
    return []


def defined_names(node: ast.stmt) -> list[str]:
    """The names a module-level statement defines: a function's or class's, or an assignment's targets."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return [n for t in targets for n in _target_names(t)]


def _loads(nodes) -> set[str]:
    """Names read in these expressions (evaluated in module scope)."""
    return {sub.id for node in nodes if node is not None for sub in ast.walk(node)
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load)}


def _dead_ifs(node: ast.AST, dead: set[str]) -> list[ast.If]:
    """The ``if NAME != 0:`` statements (no else) in ``node`` whose NAME is in ``dead``."""
    return [n for n in ast.walk(node) if isinstance(n, ast.If) and not n.orelse and ast.unparse(n.test) in
            {f"{name} != 0" for name in dead}]


def _attributes(node: ast.AST) -> dict[str, set[str]]:
    """name -> attributes read from it (``K.x`` gives K -> {x})."""
    found: dict[str, set[str]] = {}
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name):
            found.setdefault(sub.value.id, set()).add(sub.attr)
    return found


def _scope_globals(table: symtable.SymbolTable) -> set[str]:
    """Global names a function or class scope reads, nested scopes included."""
    return {s.get_name() for s in table.get_symbols() if s.is_global() and s.is_referenced()}.union(
        *map(_scope_globals, table.get_children()))


class PythonShaker:
    """What entries reach in ``roots`` and the modules they import; ``read`` and ``is_module`` see the source."""

    def __init__(self, roots: tuple[str, ...], read: Callable[[str], str], is_module: Callable[[str], bool]):
        self.order: list[str] = []  # dependencies first: the order of the file's sections
        self.modules: dict[str, _Module] = {}
        for root in roots:
            self._load(root, read, is_module, [])
        self.kept: set[tuple[str, int]] = set()  # (module, statement index)
        self.ext: dict[str, tuple[str, ast.AST]] = {}  # bound name -> (import text, node)
        self.aliases: dict[tuple[str, str], str] = {}  # (module, alias) -> the name it stands for
        self.namespaces: dict[tuple[str, str], tuple[str, set[str]]] = {}  # (module, alias) -> (target, names)
        self.owner: dict[str, tuple[str, int]] = {}  # emitted name -> (module, statement index)
        self.extra: dict[str, set[str]] = {}  # module -> names reached dynamically (e.g. kernels by name)
        # Constexprs never set from their default 0: their ``if NAME != 0:`` blocks, and what only they reach, go.
        self.dead: set[str] = set()

    def _load(self, path: str, read, is_module, visiting: list[str]) -> None:
        """Parse ``path`` after the modules it imports relatively, in the order it names them."""
        if path in self.modules:
            return
        if path in visiting:
            raise ShakeError(f"import cycle {' -> '.join(visiting + [path])}: the exporter needs an order")
        source = read(path)
        tree = ast.parse(source)
        module = _Module(path, source, tree, symtable.symtable(source, path, "exec"))
        for i, node in enumerate(tree.body):
            self._bind(module, i, node, is_module)
        for dep in module.imports:
            self._load(dep, read, is_module, visiting + [path])
        self.modules[path] = module
        self.order.append(path)

    def _bind(self, module: _Module, i: int, node: ast.stmt, is_module) -> None:
        where = f"convt3d/{module.path}:{node.lineno}"
        if isinstance(node, ast.ImportFrom) and node.level > 0:  # a module, or a name from one ('pkg/m.py')
            base = "/".join(module.path.split("/")[:-node.level] + (node.module.split(".") if node.module else []))
            for a in node.names:
                as_module = f"{base}/{a.name}.py" if base else f"{a.name}.py"
                target = as_module if is_module(as_module) else f"{base}.py" if is_module(f"{base}.py") else \
                    f"{base}/__init__.py"
                if not is_module(target):
                    raise ShakeError(f"{where}: cannot find the module it imports")
                if target not in module.imports:
                    module.imports.append(target)
                module.bindings[a.asname or a.name] = ("alias", target) if target == as_module else \
                    ("from", target, a.name)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            plain = isinstance(node, ast.Import)
            for top in [a.name.split(".")[0] for a in node.names] if plain else [(node.module or "").split(".")[0]]:
                if top == "convt3d":
                    raise ShakeError(f"{where}: package imports must be relative ('from .x import y') for the exporter "
                                     "to inline them")
                if top not in ("torch", "triton") and top not in sys.stdlib_module_names:
                    raise ShakeError(f"{where}: imports {top!r}; a KernelBench file may import only torch, triton and "
                                     "the standard library")
            if not plain and node.module == "__future__":
                return
            for a in node.names:
                name = a.asname or (a.name.split(".")[0] if plain else a.name)
                single = ast.Import([a]) if plain else ast.ImportFrom(node.module, [a], 0)
                module.bindings[name] = ("ext", ast.unparse(single), node)
            return
        for name in defined_names(node):
            if name != "__all__":
                module.bindings[name] = ("stmt", i)

    def _references(self, module: _Module, node: ast.stmt) -> tuple[set[str], dict[str, set[str]]]:
        names: set[str] = set()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if isinstance(node, ast.ClassDef):
                names |= _loads(node.bases) | _loads(k.value for k in node.keywords)
            else:
                names |= _loads(node.args.defaults) | _loads(node.args.kw_defaults)
            names |= _loads(node.decorator_list)
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            tables = [t for t in module.table.get_children()
                      if t.get_name() == node.name and first <= t.get_lineno() <= node.lineno]
            if len(tables) != 1:
                raise ShakeError(f"convt3d/{module.path}:{node.lineno}: no single scope for {node.name!r}")
            names |= _scope_globals(tables[0])
            ifs = _dead_ifs(node, self.dead)
            if ifs:
                live = ast.parse(ast.unparse(node))
                for block in _dead_ifs(live, self.dead):
                    block.body, block.test = [], ast.Constant(False)
                names -= _loads(ifs) - _loads([live])
        else:  # not an annotation: the package's are lazy (``from __future__ import annotations``)
            names |= _loads([node.value] if isinstance(node, ast.AnnAssign) else [node])
        return names, _attributes(node)

    def reach(self, entries: list[tuple[str, str]], dynamic: dict[str, set[str]] | None = None) -> None:
        """Keep what ``entries`` (module, name) reach, and ``dynamic`` (module -> names looked up at run time)."""
        for path, names in (dynamic or {}).items():
            self.extra.setdefault(path, set()).update(names)
            entries = entries + [(path, n) for n in sorted(names)]
        work = list(entries)
        seen: set[tuple[str, str]] = set()
        while work:
            path, name = work.pop()
            if (path, name) in seen:
                continue
            seen.add((path, name))
            module = self.modules.get(path)
            if module is None:
                raise ShakeError(f"convt3d/{path} is not among the modules the exporter reads")
            binding = module.bindings.get(name)
            if binding is None:
                continue  # a builtin, or a name local to a scope
            kind = binding[0]
            if kind == "ext":
                prior = self.ext.setdefault(name, binding[1:])
                if prior[0] != binding[1]:
                    raise ShakeError(f"convt3d/{path}:{binding[2].lineno}: {binding[1]!r} binds {name!r}, which "
                                     f"{prior[0]!r} binds too")
            elif kind == "from":
                target, target_name = binding[1], binding[2]
                work.append((target, target_name))
                if target_name != name:
                    self.aliases[(path, name)] = target_name
            elif kind == "alias":
                ns = self.namespaces.setdefault((path, name), (binding[1], set()))[1]
                ns |= self.extra.get(binding[1], set())
                work.extend((binding[1], n) for n in ns)
            else:
                key, node = (path, binding[1]), module.tree.body[binding[1]]
                if key in self.kept:
                    continue
                for defined in defined_names(node):
                    prior = self.owner.setdefault(defined, key)
                    if prior != key:
                        raise ShakeError(f"convt3d/{path} and convt3d/{prior[0]} both define {defined!r}; the "
                                         "exported file puts them in one namespace")
                self.kept.add(key)
                names, attrs = self._references(module, node)
                work.extend((path, n) for n in names)
                for alias, used in attrs.items():
                    b = module.bindings.get(alias)
                    if b is not None and b[0] == "alias":
                        self.namespaces.setdefault((path, alias), (b[1], set()))[1].update(used)
                        work.extend((b[1], n) for n in used)
                        work.append((path, alias))

    def check_lazy_annotations(self) -> None:
        """Refuse a kept dataclass: KernelBench's loader leaves its string annotations unresolvable."""
        for path, i in sorted(self.kept):
            node = self.modules[path].tree.body[i]
            if isinstance(node, ast.ClassDef) and "dataclass" in _loads(node.decorator_list) | {
                    a for d in node.decorator_list for a in _attributes(d).get("dataclasses", ())}:
                raise ShakeError(f"convt3d/{path}:{node.lineno}: the file would carry the dataclass {node.name}, "
                                 "whose string annotations KernelBench's module loader cannot resolve")

    def defines(self, name: str) -> bool:
        """Whether a kept statement defines ``name`` (the emitted file's namespace)."""
        return name in self.owner or name in self.ext or any(a == name for _, a in (*self.aliases, *self.namespaces))

    def imports(self) -> list[str]:
        """The absolute imports kept, sorted, one ``from`` statement per module (``from m import a, b``)."""
        plain = {text for text, _ in self.ext.values() if text.startswith("import ")}
        grouped: dict[str, set[str]] = {}
        for text, _ in self.ext.values():
            if text.startswith("from "):
                module, what = text[len("from "):].split(" import ", 1)
                grouped.setdefault(module, set()).add(what)
        return sorted(plain) + [f"from {m} import {', '.join(sorted(names))}" for m, names in sorted(grouped.items())]

    def lines(self, strip: bool = False) -> list[Line]:
        """The kept statements and rewritten imports, module by module, with the comments above them;
        ``strip`` drops docstrings that are not a whole body, and a blank line between definitions."""
        out: list[Line] = []
        for path in self.order:
            module = self.modules[path]
            body: list[Line] = []
            src = module.source.split("\n")
            dropped = _docstring_lines(module.tree) if strip else set()
            dropped |= {j for n in _dead_ifs(module.tree, self.dead) for j in range(n.lineno, n.end_lineno + 1)}
            prev_simple = True
            for i, node in enumerate(module.tree.body):
                if isinstance(node, ast.ImportFrom) and node.level > 0:
                    where = f"convt3d/{path}:{node.lineno} (rewritten import)"
                    for a in node.names:
                        name = a.asname or a.name
                        if (path, name) in self.namespaces:
                            names = self.namespaces[(path, name)][1]
                            items = "".join(f"    {n}={n},\n" for n in sorted(names))
                            text = f"{name} = types.SimpleNamespace(\n{items})" if names else \
                                f"{name} = types.SimpleNamespace()"
                            body += [Line(t, where) for t in text.split("\n")]
                        elif (path, name) in self.aliases:
                            body.append(Line(f"{name} = {self.aliases[(path, name)]}", where))
                    continue
                if (path, i) not in self.kept:
                    continue
                first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
                while first > 0 and src[first - 1].lstrip().startswith("#"):
                    first -= 1
                kept = [j for j in range(first, node.end_lineno) if j + 1 not in dropped]
                if body:
                    body += [Line("", "generated")] * (0 if _is_simple(node) and prev_simple else 1 if strip else 2)
                body += [Line(src[j], f"convt3d/{path}:{j + 1}") for j in kept]
                prev_simple = _is_simple(node) and kept[0] == node.lineno - 1
            if body:
                how = "without docstrings" if strip else "verbatim"
                out.append(Line(f"# {'=' * 20} convt3d/{path} (what this file reaches, {how}) {'=' * 20}", "generated"))
                out += body + [Line("", "generated"), Line("", "generated")]
        return out


def _docstring_lines(tree: ast.Module) -> set[int]:
    """1-based lines of the functions' and classes' docstrings where the body has another statement."""
    return {j for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and len(node.body) > 1 and ast.get_docstring(node, clean=False) is not None
            for j in range(node.body[0].lineno, node.body[0].end_lineno + 1)}


def _is_simple(node: ast.stmt) -> bool:
    """A one-statement assignment or import: kept next to its neighbours without blank lines."""
    return isinstance(node, (ast.Assign, ast.AnnAssign, ast.Import, ast.ImportFrom)) and node.lineno == node.end_lineno
