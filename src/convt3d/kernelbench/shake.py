"""Tree-shaking of the package source for the KernelBench files: only what an entry reaches.

``PythonShaker`` reads the package modules a file may draw on and keeps, from a set of entry
names, every top-level definition they reach, transitively: a function's or class's global
names (``symtable``, so a local that shadows a module-level name reaches nothing), the names its
decorators and defaults evaluate at module scope, and the attributes read from a module alias
(``K.flat_gemm_kernel``). Annotations reach nothing: a file starts with ``from __future__ import
annotations``, so they stay strings (``check_lazy_annotations`` refuses a dataclass, which would
resolve them). Kept statements are copied with the comment lines directly above them (verbatim,
or without docstrings, or also without comment lines: ``lines``); package-relative imports
become nothing (the name is defined earlier in the same file), ``alias = name`` (an ``as``
import), or a ``types.SimpleNamespace`` of the reached names (a module alias); absolute imports
of reached names are hoisted to the top. Every module's names share one namespace in the file,
so two reached definitions of one name are refused.

``prune_cuda`` does the same by lines for the .cu source of the CUDA entry: top-level items
(functions, structs, constants) kept when reached from the entry points by identifier, the
``case`` labels of launch variants the file never selects and explicit instantiations dropped,
``if constexpr`` branches decided where the condition is fixed for every kept instantiation,
and comment lines kept or dropped.
"""
from __future__ import annotations

import ast
import re
import symtable
import sys
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["ShakeError", "Line", "PythonShaker", "prune_cuda"]

_ALLOWED_THIRD_PARTY = frozenset({"torch", "triton"})


class ShakeError(RuntimeError):
    """The source cannot be shaken as it is (the message names the module and line)."""


@dataclass
class Line:
    text: str
    origin: str  # "convt3d/<module>:<line>" or "generated"


# ---- Python ---------------------------------------------------------------------------------------
@dataclass
class _Stmt:
    module: str
    node: ast.stmt
    index: int  # position in the module body
    defines: tuple[str, ...]


@dataclass
class _Module:
    path: str
    source: str
    tree: ast.Module
    table: symtable.SymbolTable
    # name -> ("stmt", _Stmt) | ("from", module path, name) | ("alias", module path) | ("ext", node, alias)
    bindings: dict[str, tuple] = field(default_factory=dict)
    statements: list[_Stmt] = field(default_factory=list)


def _resolve_base(node: ast.ImportFrom, importer: str) -> str:
    package = importer.split("/")[:-1]
    base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
    return "/".join(base + ([node.module.replace(".", "/")] if node.module else []))


def _check_absolute_import(node: ast.AST, where: str) -> None:
    tops = ([a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import)
            else [(node.module or "").split(".")[0]])
    for top in tops:
        if top == "__future__":
            continue
        if top == "convt3d":
            raise ShakeError(f"{where}: package imports must be relative ('from .x import y') for the exporter to "
                             "inline them")
        if top not in _ALLOWED_THIRD_PARTY and top not in sys.stdlib_module_names:
            raise ShakeError(f"{where}: imports {top!r}; a KernelBench file may import only torch, triton and the "
                             "standard library")


def _target_names(target: ast.expr) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for e in target.elts for n in _target_names(e)]
    return []


def _loads(nodes) -> set[str]:
    """Names read in these expressions (evaluated in module scope)."""
    found: set[str] = set()
    for node in nodes:
        if node is None:
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
                found.add(sub.id)
    return found


def _attributes(node: ast.AST) -> dict[str, set[str]]:
    """name -> attributes read from it (``K.x`` gives K -> {x})."""
    found: dict[str, set[str]] = {}
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name):
            found.setdefault(sub.value.id, set()).add(sub.attr)
    return found


def _scope_globals(table: symtable.SymbolTable) -> set[str]:
    """Global names a function or class scope reads, nested scopes included."""
    names = {s.get_name() for s in table.get_symbols() if s.is_global() and s.is_referenced()}
    for child in table.get_children():
        names |= _scope_globals(child)
    return names


class PythonShaker:
    """The top-level definitions of ``paths`` (package-relative, dependencies first) that entries
    reach; ``read(path)`` gives a module's source."""

    def __init__(self, paths: tuple[str, ...], read: Callable[[str], str], is_module: Callable[[str], bool]):
        self.order = list(paths)
        self.modules: dict[str, _Module] = {}
        for path in paths:
            source = read(path)
            tree = ast.parse(source)
            module = _Module(path, source, tree, symtable.symtable(source, path, "exec"))
            for i, node in enumerate(tree.body):
                self._bind(module, i, node, is_module)
            self.modules[path] = module
        self.kept: set[tuple[str, int]] = set()  # (module, statement index)
        self.ext: dict[str, tuple[str, ast.AST]] = {}  # bound name -> (import text, node)
        self.aliases: dict[tuple[str, str], str] = {}  # (module, alias) -> the name it stands for
        self.namespaces: dict[tuple[str, str], tuple[str, set[str]]] = {}  # (module, alias) -> (target, names)
        self.owner: dict[str, tuple[str, int]] = {}  # emitted name -> (module, statement index)
        self.extra: dict[str, set[str]] = {}  # module -> names reached dynamically (e.g. kernels by name)

    # -- binding table ------------------------------------------------------------------------------
    def _bind(self, module: _Module, i: int, node: ast.stmt, is_module) -> None:
        where = f"convt3d/{module.path}:{node.lineno}"
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = _resolve_base(node, module.path)
            for a in node.names:
                as_module = f"{base}/{a.name}.py" if base else f"{a.name}.py"
                name = a.asname or a.name
                if is_module(as_module):
                    module.bindings[name] = ("alias", as_module)
                else:
                    target = f"{base}.py" if is_module(f"{base}.py") else f"{base}/__init__.py"
                    module.bindings[name] = ("from", target, a.name)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            _check_absolute_import(node, where)
            if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                return
            for a in node.names:
                if isinstance(node, ast.Import):
                    name = a.asname or a.name.split(".")[0]
                    text = f"import {a.name}" + (f" as {a.asname}" if a.asname else "")
                else:
                    name = a.asname or a.name
                    text = f"from {node.module} import {a.name}" + (f" as {a.asname}" if a.asname else "")
                module.bindings[name] = ("ext", text, node)
            return
        defines: list[str] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defines = [node.name]
        elif isinstance(node, ast.Assign):
            defines = [n for t in node.targets for n in _target_names(t)]
        elif isinstance(node, ast.AnnAssign):
            defines = _target_names(node.target)
        stmt = _Stmt(module.path, node, i, tuple(defines))
        module.statements.append(stmt)
        for name in defines:
            if name != "__all__":
                module.bindings[name] = ("stmt", stmt)

    # -- reachability -------------------------------------------------------------------------------
    def _references(self, module: _Module, stmt: _Stmt) -> tuple[set[str], dict[str, set[str]]]:
        node = stmt.node
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
        elif isinstance(node, ast.AnnAssign):
            names |= _loads([node.value])
        else:
            names |= _loads([node])
        return names, _attributes(node)

    def reach(self, entries: list[tuple[str, str]], dynamic: dict[str, set[str]] | None = None) -> None:
        """Keep what ``entries`` ((module, name) pairs) reach; ``dynamic``: module -> names reached
        at run time by name (a kernel a launch site names), kept and listed in that module's
        namespace where another module holds it as an alias."""
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
                self._keep_ext(name, binding[1], binding[2], path)
            elif kind == "from":
                target, target_name = binding[1], binding[2]
                work.append((target, target_name))
                if target_name != name:
                    self.aliases[(path, name)] = target_name
            elif kind == "alias":
                target = binding[1]
                ns = self.namespaces.setdefault((path, name), (target, set()))[1]
                ns |= self.extra.get(target, set())
                work.extend((target, n) for n in ns)
            else:
                stmt = binding[1]
                if (path, stmt.index) in self.kept:
                    continue
                self._own(stmt)
                self.kept.add((path, stmt.index))
                names, attrs = self._references(module, stmt)
                work.extend((path, n) for n in names)
                for alias, used in attrs.items():
                    b = module.bindings.get(alias)
                    if b is not None and b[0] == "alias":
                        self.namespaces.setdefault((path, alias), (b[1], set()))[1].update(used)
                        work.extend((b[1], n) for n in used)
                        work.append((path, alias))

    def kept_nodes(self):
        """(module, node) of every kept statement, in module order."""
        for path in self.order:
            for i, node in enumerate(self.modules[path].tree.body):
                if (path, i) in self.kept:
                    yield path, node

    def check_lazy_annotations(self) -> None:
        """A kept dataclass would need its annotations evaluated (KernelBench's loader does not
        register the module, where ``dataclasses`` looks string annotations up): refuse it."""
        for path, node in self.kept_nodes():
            if isinstance(node, ast.ClassDef) and "dataclass" in _loads(node.decorator_list) | {
                    a for d in node.decorator_list for a in _attributes(d).get("dataclasses", ())}:
                raise ShakeError(f"convt3d/{path}:{node.lineno}: the file would carry the dataclass {node.name}, "
                                 "whose string annotations KernelBench's module loader cannot resolve")

    def _own(self, stmt: _Stmt) -> None:
        for name in stmt.defines:
            prior = self.owner.get(name)
            if prior is not None and prior != (stmt.module, stmt.index):
                raise ShakeError(f"convt3d/{stmt.module} and convt3d/{prior[0]} both define {name!r}; the exported "
                                 "file puts them in one namespace")
            self.owner[name] = (stmt.module, stmt.index)

    def _keep_ext(self, name: str, text: str, node: ast.AST, path: str) -> None:
        prior = self.ext.get(name)
        if prior is not None and prior[0] != text:
            raise ShakeError(f"convt3d/{path}:{node.lineno}: {text!r} binds {name!r}, which {prior[0]!r} binds too")
        self.ext.setdefault(name, (text, node))

    def defines(self, name: str) -> bool:
        """Whether a kept statement defines ``name`` (the emitted file's namespace)."""
        return name in self.owner or any(a == name for (_, a) in self.aliases) \
            or any(a == name for (_, a) in self.namespaces) or name in self.ext

    # -- output -------------------------------------------------------------------------------------
    def imports(self) -> list[str]:
        """The absolute imports kept, one statement per module (``from m import a, b``)."""
        plain: list[str] = []
        grouped: dict[str, list[str]] = {}
        for text, _ in self.ext.values():
            if text.startswith("import "):
                if text not in plain:
                    plain.append(text)
            else:
                module, what = text[len("from "):].split(" import ", 1)
                grouped.setdefault(module, [])
                if what not in grouped[module]:
                    grouped[module].append(what)
        return sorted(plain) + [f"from {m} import {', '.join(sorted(names))}" for m, names in sorted(grouped.items())]

    def lines(self, strip: int = 0) -> list[Line]:
        """The kept statements, module by module in dependency order, with the comment lines
        directly above each, and the rewritten package imports. ``strip``: 0 verbatim, 1 without
        the docstrings of the definitions (where a body keeps another statement) and one blank
        line between definitions, 2 also without comment-only lines."""
        out: list[Line] = []
        for path in self.order:
            module = self.modules[path]
            body: list[Line] = []
            src = module.source.split("\n")
            dropped = _docstring_lines(module.tree) if strip >= 1 else set()
            if strip >= 2:
                dropped |= _comment_lines(module.source)
            prev_simple = True
            for i, node in enumerate(module.tree.body):
                if isinstance(node, ast.ImportFrom) and node.level > 0:
                    for a in node.names:
                        name = a.asname or a.name
                        if (path, name) in self.namespaces:
                            _, names = self.namespaces[(path, name)]
                            items = "".join(f"    {n}={n},\n" for n in sorted(names))
                            text = f"{name} = types.SimpleNamespace(\n{items})" if names else \
                                f"{name} = types.SimpleNamespace()"
                            body += [Line(t, f"convt3d/{path}:{node.lineno} (rewritten import)")
                                     for t in text.split("\n")]
                        elif (path, name) in self.aliases:
                            body.append(Line(f"{name} = {self.aliases[(path, name)]}",
                                             f"convt3d/{path}:{node.lineno} (rewritten import)"))
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
                how = ("verbatim", "without docstrings", "without docstrings and comment lines")[strip]
                out.append(Line(f"# {'=' * 20} convt3d/{path} (what this file reaches, {how}) {'=' * 20}",
                                "generated"))
                out += body + [Line("", "generated"), Line("", "generated")]
        return out


def _docstring_lines(tree: ast.Module) -> set[int]:
    """1-based lines of the docstrings of every function and class (not the module's), where
    the body has another statement to stand for it."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and len(node.body) > 1 \
                and ast.get_docstring(node, clean=False) is not None:
            found.update(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    return found


def _comment_lines(source: str) -> set[int]:
    """1-based lines that hold nothing but a comment."""
    import io
    import tokenize

    found: set[int] = set()
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            found.add(tok.start[0])
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    return found - code_lines


def _is_simple(node: ast.stmt) -> bool:
    """A one-statement assignment or import: kept next to its neighbours without blank lines."""
    return isinstance(node, (ast.Assign, ast.AnnAssign, ast.Import, ast.ImportFrom)) and node.lineno == node.end_lineno


# ---- CUDA C++ -------------------------------------------------------------------------------------
_IDENT = re.compile(r"[A-Za-z_]\w*")


def _mask(line: str) -> str:
    """A line with its // comment and the contents of its string and char literals blanked
    (same length), so braces and identifiers are the code's own."""
    out = re.sub(r'"(?:\\.|[^"\\])*"', lambda m: '"' + " " * (len(m.group(0)) - 2) + '"', line)
    out = re.sub(r"'(?:\\.|[^'\\])'", lambda m: " " * len(m.group(0)), out)
    cut = out.find("//")
    return out if cut < 0 else out[:cut] + " " * (len(out) - cut)


@dataclass
class _Item:
    first: int  # line index (0-based)
    last: int
    name: str  # what it defines ("" for none)
    kind: str  # "code", "comment", "blank", "pre", "namespace", "instantiation"


def _defined_name(text: str) -> str:
    """The name a top-level C++ declaration or definition introduces."""
    text = re.sub(r"template\s*<[^>]*>", " ", text)
    text = re.sub(r"__launch_bounds__\s*\([^)]*\)", " ", text)
    head = re.split(r"[=({\[;]", text, maxsplit=1)[0]
    names = _IDENT.findall(head)
    return names[-1] if names else ""


def _items(lines: list[str], masked: list[str]) -> list[_Item]:
    """Top-level items: from a statement's first line to its closing ';' or the closing brace of
    its body, at namespace depth (the braces of ``namespace x {`` do not nest)."""
    items: list[_Item] = []
    i, n = 0, len(masked)
    while i < n:
        code = masked[i].strip()
        if not code:
            items.append(_Item(i, i, "", "comment" if lines[i].strip() else "blank"))
            i += 1
            continue
        if code.startswith("#"):
            items.append(_Item(i, i, "", "pre"))
            i += 1
            continue
        if re.fullmatch(r"namespace\s+\w+\s*\{", code) or code == "}":
            items.append(_Item(i, i, "", "namespace"))
            i += 1
            continue
        depth, j, opened = 0, i, False
        while j < n:
            c = masked[j]
            depth += c.count("{") + c.count("(") - c.count("}") - c.count(")")
            opened = opened or "{" in c
            tail = c.rstrip()
            if depth == 0 and (tail.endswith(";") or (opened and tail.endswith("}"))):
                break
            j += 1
        text = " ".join(masked[k] for k in range(i, j + 1))
        kind = "instantiation" if re.match(r"template\s+(?!<)", code) else "code"
        items.append(_Item(i, j, _defined_name(text), kind))
        i = j + 1
    return items


def _close(masked: list[str], line: int, col: int) -> tuple[int, int]:
    """(line, column) of the brace closing the one at (line, col)."""
    depth = 0
    for i in range(line, len(masked)):
        for j in range(col if i == line else 0, len(masked[i])):
            ch = masked[i][j]
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return i, j
    raise ShakeError(f"unbalanced braces from line {line + 1}")


def _decide_constexpr(lines: list[tuple[int, str]], fixed: dict[str, bool]) -> list[tuple[int, str]]:
    """``if constexpr (cond) { A } else { B }`` where ``fixed`` decides ``cond`` (template
    parameters with one value in every kept instantiation) becomes the block it takes."""
    out = list(lines)
    i = 0
    while i < len(out):
        m = re.fullmatch(r"(\s*)if constexpr \((.*)\) \{\s*", _mask(out[i][1]).rstrip() + " ")
        names = set(_IDENT.findall(m.group(2))) if m else set()
        if not m or not names or not names <= set(fixed) or re.search(r"[^\w\s!&|()]", m.group(2)):
            i += 1
            continue
        expr = m.group(2).replace("&&", " and ").replace("||", " or ").replace("!", " not ")
        value = bool(eval(expr, {"__builtins__": {}}, dict(fixed)))  # noqa: S307 - names and ! && || only
        masked = [_mask(t) for _, t in out]
        end, _ = _close(masked, i, masked[i].rindex("{"))
        then_body, else_body, last = out[i + 1:end], [], end
        if re.fullmatch(r"\s*\}\s*else\s*\{\s*", masked[end]):
            last, _ = _close(masked, end, masked[end].rindex("{"))
            else_body = out[end + 1:last]
        elif masked[end].strip() != "}":
            i += 1
            continue
        body = then_body if value else else_body
        indent = m.group(1)
        out[i:last + 1] = ([(out[i][0], indent + "{")] + body + [(out[last][0], indent + "}")]) if body else []
        i += 1
    return out


def prune_cuda(text: str, roots: set[str], drop_cases: set[int], fixed: dict[str, bool],
               comments: bool = True) -> list[tuple[int, str]]:
    """(source line, text) of the .cu lines a file needs: preprocessor lines, namespaces, and the
    top-level items ``roots`` reach by identifier, without the ``case N:`` lines of
    ``drop_cases`` (launch variants the file never selects) or explicit instantiations (the
    compile instantiates what the launcher calls), with ``if constexpr`` branches that ``fixed``
    decides resolved; ``comments``: keep comment lines (within and above kept items)."""
    lines = text.split("\n")
    for idx, line in enumerate(lines):
        m = re.match(r"\s*case (-?\d+):", line)
        if m and int(m.group(1)) in drop_cases:
            lines[idx] = ""
    masked = [_mask(t) for t in lines]
    items = _items(lines, masked)
    by_name: dict[str, list[_Item]] = {}
    for item in items:
        if item.kind == "code" and item.name:
            by_name.setdefault(item.name, []).append(item)
    kept: set[int] = set()
    work, seen = list(roots), set()
    while work:
        name = work.pop()
        if name in seen:
            continue
        seen.add(name)
        for item in by_name.get(name, []):
            kept.add(item.first)
            for k in range(item.first, item.last + 1):
                work.extend(_IDENT.findall(masked[k]))
    out: list[tuple[int, str]] = []
    pending: list[tuple[int, str]] = []  # comment lines waiting for the item they precede
    for item in items:
        if item.kind in ("comment", "blank"):
            if item.kind == "comment" and comments:
                pending.append((item.first + 1, lines[item.first]))
            elif item.kind == "blank":
                pending = []
                if out and out[-1][1] != "":
                    out.append((item.first + 1, ""))
            continue
        if item.kind in ("code", "instantiation") and item.first not in kept:
            pending = []
            continue
        out += pending
        pending = []
        for k in range(item.first, item.last + 1):
            if masked[k].strip() or (comments and lines[k].strip()):
                out.append((k + 1, lines[k]))
    while out and out[-1][1] == "":
        out.pop()
    collapsed: list[tuple[int, str]] = []
    for entry in out:
        if not (entry[1] == "" and collapsed and collapsed[-1][1] == ""):
            collapsed.append(entry)
    return _decide_constexpr(collapsed, fixed)
