"""Every call into the compiled modules, checked against their pybind11 signatures without a GPU.

An AST walk over python/, perf/, tests/, examples/ and scripts/ finds each call ``<m>.<name>(...)``
where ``<m>`` is ``ultracomm._cuda`` or ``ultracomm._core`` -- however the file holds it: ``_cuda``,
``self._cuda``, a name assigned from ``cuda_runtime(...)`` / ``cuda_module()``, ``_core`` /
``_core_mod`` / ``_core()`` -- and each method call on a ``_cuda.Runner`` / ``PlanArena``
(receivers named ``runner`` / ``arena``, or assigned from ``<m>.Runner(...)``).  For each: the
name exists in the module (or class), the positional count and keyword names fit the signature
pybind11 writes as the docstring's first line (``name(a: int, b: float = 0.0) -> None``; an
overloaded function fits if one overload does), no required argument is missing, and a literal
argument has a type the parameter accepts (a float literal for an int, None where None is not
allowed).  ``**kwargs`` built by a function of the sources returning ``dict(k=...)`` (e.g.
``DeviceSchedule.build_args``) count as those keywords.

A GPU run's first pass used to find such slips one failing test at a time (run 1: wrong argument
names, perf/gpu/README.md); the ``_cuda`` module builds wherever nvcc is, so they are found here.
Calls inside ``with pytest.raises(...)`` are deliberate and skipped.
"""

from __future__ import annotations

import ast
import dataclasses
import glob
import os
import re
import textwrap

import pytest

from ultracomm import _core

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIRS = ("python", "perf", "tests", "examples", "scripts")
HERE = os.path.abspath(__file__)

#: calls whose result is the ``_cuda`` module
CUDA_FACTORIES = {"cuda_runtime", "cuda_module"}
#: receivers of the pybind classes' methods, by the last name of the receiver expression
CLASS_RECEIVERS = {"runner": "Runner", "_runner": "Runner", "arena": "PlanArena", "_arena": "PlanArena"}
#: their methods (csrc/cuda/bind_cuda.cpp), to tell them from other runners' where the file does not hold _cuda
CLASS_METHODS = {
    "Runner": {
        "launch",
        "launch_slot",
        "build_slot",
        "write_template",
        "take_error",
        "max_coresident",
        "launch_ctas",
        "max_ctas_per_rank",
    },
    "PlanArena": {"build_result", "retire"},
}


def cuda_or_none():
    from ultracomm.cuda.support import cuda_module

    return cuda_module()


@dataclasses.dataclass
class Param:
    name: str
    type: str
    default: bool
    kw_only: bool = False


@dataclasses.dataclass
class Site:
    path: str
    line: int
    module: str  # "_cuda" | "_core"
    cls: str | None  # "Runner", "PlanArena", ... or None for a module attribute
    name: str
    call: ast.Call | None  # None: an attribute read
    kwargs_keys: set | None = None  # keys of **dict(...) a function of the sources returns; None: unknown

    def where(self) -> str:
        what = f"{self.module}.{self.cls + '.' if self.cls else ''}{self.name}"
        return f"{os.path.relpath(self.path, ROOT)}:{self.line}: {what}"


def _split_top(s: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def parse_signatures(fn, name: str, method: bool) -> list[list[Param]]:
    """Each overload's parameters from pybind11's docstring (``self`` dropped for a method)."""
    doc = getattr(fn, "__doc__", None) or ""
    heads = [ln.strip() for ln in doc.splitlines() if re.match(rf"^\s*(\d+\.\s*)?{re.escape(name)}\(", ln)]
    sigs = []
    for head in heads:
        head = re.sub(r"^\d+\.\s*", "", head)
        body, depth = "", 0
        for ch in head[len(name) + 1 :]:
            if ch == "(":
                depth += 1
            elif ch == ")":
                if depth == 0:
                    break
                depth -= 1
            body += ch
        params, kw_only = [], False
        for p in _split_top(body):
            if p == "*":
                kw_only = True
                continue
            if p.startswith("*"):  # *args / **kwargs: anything fits
                return []
            pname, _, rest = p.partition(":")
            ptype, eq, _ = rest.partition("=")
            params.append(Param(pname.strip(), ptype.strip(), bool(eq), kw_only))
        if method and params and params[0].name == "self":
            params = params[1:]
        sigs.append(params)
    return sigs


def _literal_fits(node: ast.AST, ptype: str) -> str | None:
    """Why literal ``node`` cannot convert to a parameter of pybind type ``ptype``, or None."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    if not isinstance(node, ast.Constant):
        return None
    v = node.value
    if v is None:
        return None if "None" in ptype or ptype == "object" else f"None for {ptype}"
    if isinstance(v, bool) or ptype in ("object", "") or "Any" in ptype:
        return None
    if isinstance(v, float) and "SupportsFloat" not in ptype and "float" not in ptype:
        return f"float literal {v!r} for {ptype}"
    if isinstance(v, str) and "str" not in ptype:
        return f"str literal {v!r} for {ptype}"
    return None


def fits(params: list[Param], call: ast.Call, kwargs_keys: set | None) -> str | None:
    """Why ``call`` does not fit ``params``, or None."""
    if any(isinstance(a, ast.Starred) for a in call.args):
        return None
    pos = [p for p in params if not p.kw_only]
    if len(call.args) > len(pos):
        return f"{len(call.args)} positional arguments, the signature takes at most {len(pos)}"
    filled = {p.name for p in pos[: len(call.args)]}
    names = {p.name: p for p in params}
    for p, a in zip(pos, call.args):
        why = _literal_fits(a, p.type)
        if why:
            return f"argument {p.name}: {why}"
    splat = False
    for kw in call.keywords:
        if kw.arg is None:
            splat = True
            continue
        if kw.arg not in names or re.fullmatch(r"arg\d+", kw.arg):
            return f"keyword {kw.arg!r} is not a parameter (parameters: {', '.join(names)})"
        if kw.arg in filled:
            return f"keyword {kw.arg!r} also given positionally"
        why = _literal_fits(kw.value, names[kw.arg].type)
        if why:
            return f"argument {kw.arg}: {why}"
        filled.add(kw.arg)
    if splat:
        if kwargs_keys is None:
            return None  # keys unknown: anything missing may come from there
        for k in kwargs_keys:
            if k not in names:
                return f"keyword {k!r} (from **kwargs) is not a parameter (parameters: {', '.join(names)})"
            if k in filled:
                return f"keyword {k!r} (from **kwargs) also given"
        filled |= kwargs_keys
    missing = [p.name for p in params if not p.default and p.name not in filled]
    if missing:
        return f"missing required arguments {missing}"
    return None


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_core" and not node.args:
        parts.append("_core()")
        return ".".join(reversed(parts))
    return None


def dict_returning_functions(trees) -> dict[str, set]:
    """{function name: keys} for functions of the sources whose every return is ``dict(k=...)`` or
    a literal with constant keys (the ``**`` arguments of a call)."""
    out: dict[str, set] = {}
    for tree in trees:
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            keys, ok = set(), False
            for r in ast.walk(fn):
                if not isinstance(r, ast.Return) or r.value is None:
                    continue
                v = r.value
                if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "dict" and not v.args:
                    if any(k.arg is None for k in v.keywords):
                        ok = False
                        break
                    keys |= {k.arg for k in v.keywords}
                    ok = True
                elif isinstance(v, ast.Dict) and all(isinstance(k, ast.Constant) for k in v.keys):
                    keys |= {k.value for k in v.keys}
                    ok = True
                else:
                    ok = False
                    break
            if ok:
                out[fn.name] = keys if fn.name not in out else out[fn.name] & keys
    return out


class Finder(ast.NodeVisitor):
    """The sites of one file (see the module docstring)."""

    def __init__(self, path: str, tree: ast.AST, dict_fns: dict[str, set]):
        self.path, self.dict_fns, self.sites = path, dict_fns, []
        self.aliases: dict[str, str] = {"_cuda": "_cuda", "_core": "_core", "_core()": "_core"}
        self.alias_attrs: dict[str, str] = {"_cuda": "_cuda", "_core": "_core"}
        self.instances: dict[str, str] = {}  # dotted receiver -> class, from X = <m>.Runner(...)
        self.functions: dict[str, tuple] = {}  # local name -> (module, name): fn, why = self.binding("name")
        self.raises_depth = 0
        self._called: set = set()  # ids of the calls' func nodes (a call is one site, not also a read)
        self._collect_aliases(tree)
        # receivers named runner / arena are taken for the pybind classes' where the file holds
        # the module, else only for methods those classes have (other runners: the queue's thread)
        self.holds_cuda = "_cuda" in {v for k, v in self.aliases.items() if k not in ("_cuda", "_core", "_core()")}
        self.holds_cuda |= "_cuda" in {v for k, v in self.alias_attrs.items() if k != "_cuda"} or bool(self.instances)

    def _module_of_value(self, v: ast.AST) -> str | None:
        if isinstance(v, ast.Call):
            f = v.func
            fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if fname in CUDA_FACTORIES:
                return "_cuda"
            if fname == "import_module" and v.args and isinstance(v.args[0], ast.Constant):
                return {"ultracomm._cuda": "_cuda", "ultracomm._core": "_core"}.get(v.args[0].value)
        return None

    def _collect_aliases(self, tree: ast.AST) -> None:
        not_modules: set = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for a in node.args.args + node.args.kwonlyargs:
                    if a.arg in ("cuda", "_cuda"):  # def arena_bytes(cuda, ...): the module passed in
                        self.aliases[a.arg] = "_cuda"
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Attribute)
                and node.value.func.attr == "binding"  # perf/single_gpu (bench_gpu): fn, why = self.binding("name")
                and node.value.args
                and isinstance(node.value.args[0], ast.Constant)
                and isinstance(node.targets[0], ast.Tuple)
                and isinstance(node.targets[0].elts[0], ast.Name)
            ):
                self.functions[node.targets[0].elts[0].id] = ("_cuda", node.value.args[0].value)
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if a.name in ("_cuda", "_core") and (node.module or "").split(".")[-1] in ("ultracomm", ""):
                        self.aliases[a.asname or a.name] = a.name
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in ("ultracomm._cuda", "ultracomm._core") and a.asname:
                        self.aliases[a.asname] = a.name.split(".")[-1]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                mod = self._module_of_value(node.value)
                cls = self._class_of_value(node.value)
                for t in targets:
                    d = _dotted(t)
                    if d is None:
                        continue
                    if isinstance(t, ast.Attribute) and t.attr in ("_cuda", "_core") and not mod:
                        if self.module_of(node.value) is None:  # self._core = a schedule's result
                            not_modules.add(t.attr)
                    if mod:
                        if isinstance(t, ast.Attribute):
                            self.alias_attrs[t.attr] = mod
                        else:
                            self.aliases[d] = mod
                    if cls:
                        self.instances[d] = cls
        for attr in not_modules:
            self.alias_attrs.pop(attr, None)

    def _class_of_value(self, v: ast.AST) -> str | None:
        for n in ast.walk(v):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("Runner", "PlanArena"):
                if self.module_of(n.func.value) == "_cuda":
                    return n.func.attr
        return None

    def module_of(self, node: ast.AST) -> str | None:
        d = _dotted(node)
        if d is None:
            return None
        if d in self.aliases:
            return self.aliases[d]
        if isinstance(node, ast.Attribute) and node.attr in self.alias_attrs and "torch" not in d.split("."):
            return self.alias_attrs[node.attr]
        return None

    def class_of(self, node: ast.AST) -> str | None:
        d = _dotted(node)
        if d is None:
            return None
        if d in self.instances:
            return self.instances[d]
        return CLASS_RECEIVERS.get(d.split(".")[-1])

    def visit_With(self, node: ast.With) -> None:
        raises = any(
            isinstance(i.context_expr, ast.Call) and (_dotted(i.context_expr.func) or "").endswith("raises")
            for i in node.items
        )
        self.raises_depth += raises
        self.generic_visit(node)
        self.raises_depth -= raises

    def _kwargs_keys(self, call: ast.Call) -> set | None:
        keys: set = set()
        for kw in call.keywords:
            if kw.arg is not None:
                continue
            v = kw.value.func if isinstance(kw.value, ast.Call) else kw.value  # **f(...) or **x.f
            fname = v.attr if isinstance(v, ast.Attribute) else getattr(v, "id", None)
            if fname not in self.dict_fns:
                return None
            keys |= self.dict_fns[fname]
        return keys

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        if isinstance(f, ast.Name) and f.id in self.functions and not self.raises_depth:
            mod, name = self.functions[f.id]
            self.sites.append(Site(self.path, node.lineno, mod, None, name, node, self._kwargs_keys(node)))
        if isinstance(f, ast.Attribute) and not self.raises_depth:
            self._called.add(id(f))
            mod = self.module_of(f.value)
            if mod:
                self.sites.append(Site(self.path, node.lineno, mod, None, f.attr, node, self._kwargs_keys(node)))
            else:
                cls = self.class_of(f.value)
                if cls and (self.holds_cuda or _dotted(f.value) in self.instances or f.attr in CLASS_METHODS[cls]):
                    self.sites.append(Site(self.path, node.lineno, "_cuda", cls, f.attr, node, self._kwargs_keys(node)))
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, ast.Load) and not self.raises_depth and id(node) not in self._called:
            mod = self.module_of(node.value)
            if mod:
                self.sites.append(Site(self.path, node.lineno, mod, None, node.attr, None))
        self.generic_visit(node)


def find_sites(sources: dict[str, str]) -> list[Site]:
    """Every site in ``{path: source}``: calls, and reads of the modules' other attributes."""
    trees = {p: ast.parse(s, p) for p, s in sources.items()}
    dict_fns = dict_returning_functions(trees.values())
    sites = []
    for p, t in trees.items():
        fi = Finder(p, t, dict_fns)
        fi.visit(t)
        sites += fi.sites
    return sites


def check(sites: list[Site], modules: dict) -> list[str]:
    """What is wrong at each site, against the loaded ``modules`` ({"_cuda": ..., "_core": ...};
    a site of a module missing from it is not checked)."""
    problems = []
    for s in sites:
        mod = modules.get(s.module)
        if mod is None:
            continue
        owner = mod if s.cls is None else getattr(mod, s.cls, None)
        if owner is None:
            problems.append(f"{s.where()}: {s.module} has no class {s.cls}")
            continue
        if not hasattr(owner, s.name):
            problems.append(f"{s.where()}: no such {'method' if s.cls else 'name'}")
            continue
        if s.call is None:
            continue
        fn = getattr(owner, s.name)
        if isinstance(fn, type):  # a class: its constructor
            sigs = parse_signatures(fn.__init__, "__init__", True)
        else:
            sigs = parse_signatures(fn, s.name, s.cls is not None)
        if not sigs:
            if not callable(fn):
                problems.append(f"{s.where()}: not callable")
            continue  # *args / no pybind signature (a Python-level helper): not checked
        whys = [fits(p, s.call, s.kwargs_keys) for p in sigs]
        if all(whys):
            problems.append(f"{s.where()}: {whys[0]}")
    return problems


def repo_sources() -> dict[str, str]:
    out = {}
    for d in DIRS:
        for p in glob.glob(os.path.join(ROOT, d, "**", "*.py"), recursive=True):
            if os.path.abspath(p) != HERE and "/.venv/" not in p and "/build/" not in p:
                out[p] = open(p, encoding="utf-8").read()
    return out


@pytest.fixture(scope="module")
def sites():
    return find_sites(repo_sources())


def test_every_core_call_fits_its_binding(sites):
    core = [s for s in sites if s.module == "_core"]
    assert len({(s.path, s.line) for s in core if s.call is not None}) > 50  # the walk finds them
    assert check(core, {"_core": _core}) == []


def test_every_cuda_call_fits_its_binding(sites):
    cuda = cuda_or_none()
    if cuda is None:
        pytest.skip("ultracomm._cuda is not built here (no nvcc at install)")
    found = [s for s in sites if s.module == "_cuda"]
    names = {(s.cls, s.name) for s in found if s.call is not None}
    # the walk reaches the GPU-only callers (transports, loopback, load board, planner, reroute, bench)
    for want in (
        (None, "Runner"),
        (None, "PlanArena"),
        (None, "DevicePlan"),
        (None, "load_exchange"),
        (None, "quota_plan"),
        (None, "reroute_table"),
        (None, "publish_rejection"),
        ("Runner", "launch_slot"),
        ("Runner", "build_slot"),
        ("Runner", "write_template"),
        ("Runner", "launch"),
        ("PlanArena", "build_result"),
    ):
        assert want in names, want
    assert check(found, {"_cuda": cuda}) == []


BAD = """
from ultracomm import _core
from ultracomm.cuda.support import cuda_runtime

def f(self, dev, sched):
    _core.window_layut(1, 2, 3, 4)                       # no such name
    _core.window_layout(1, 2, 3, 4, 5, 6, 7)             # too many positional arguments
    cuda = cuda_runtime(dev)
    cuda.load_exchange([], 2, 8, 1, 64, 1.0, 0, 9)       # too many
    cuda.load_exchange([], 2, 8, 1, 64, 1.0)             # stream missing
    cuda.reroute_scratch_bytes(world=2, expert=8)        # wrong keyword name
    cuda.quota_scratch_bytes(2.0, 8, 1)                  # float for an int
    self._cuda = cuda_runtime(dev)
    self.runner = self._cuda.Runner(dev)
    self.runner.launch_slot(self.arena, 0, 0, None, 1, 2, 0, force_vec=True)   # wrong keyword
    self.runner.build_slot(self.arena, 0, 0, stream=0, **sched.build_args())   # keys from build_args, one wrong
    self.runner.launch_slot(None, 0, 0, None, 1, 2, 0)                         # None for the arena

class DeviceSchedule:
    def build_args(self):
        return dict(slot_src=1, home_of=2, node_of=0, world=2, slots=1, num_experts=8, rank=0, max_depth=2,
                    weight_bytes=4, grad_bytes=4, chunk_bytes=4, hop_byte=4)
"""


def test_the_check_fails_wrong_calls():
    """The check itself: each deliberately wrong call above is reported, with why."""
    cuda = cuda_or_none()
    probs = check(find_sites({os.path.join(ROOT, "bad.py"): textwrap.dedent(BAD)}), {"_core": _core, "_cuda": cuda})
    text = "\n".join(probs)
    assert "_core.window_layut: no such name" in text
    assert "_core.window_layout: 7 positional arguments, the signature takes at most 4" in text
    if cuda is None:
        return
    assert "_cuda.load_exchange: 8 positional arguments" in text
    assert "_cuda.load_exchange: missing required arguments ['stream']" in text
    assert "_cuda.reroute_scratch_bytes: keyword 'expert' is not a parameter" in text
    assert "_cuda.quota_scratch_bytes: argument world: float literal 2.0" in text
    assert "_cuda.Runner.launch_slot: keyword 'force_vec' is not a parameter" in text
    assert "_cuda.Runner.build_slot: keyword 'hop_byte' (from **kwargs) is not a parameter" in text
    assert "_cuda.Runner.launch_slot: argument arena: None for ultracomm._cuda.PlanArena" in text
    assert len(probs) == 9, text
