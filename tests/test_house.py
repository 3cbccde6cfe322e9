"""The house's rules, inside the repository (a few seconds, no model):

- rooms, from the ground up: eagle3ft's shared modules (eagle3ft/, its drafter/ and targets/) < data < train < eval;
  nothing imports a room above its own;
- eval's jobs, from the ground up: decode < offline < economics < bench < report, eval's own files (preflight.py,
  runs.py) below them all; a job imports no job above its own. Economics prices files a bench wrote and imports no
  bench code, and the bench runs the economics when it ends, so economics sits below the bench;
- no import circle between modules;
- no product file (a module of the package) over 450 lines;
- no record citation (the section sign, or a records title in parentheses), machine name or date in product code or
  shipped configs: a fact is said with its reason where it is used;
- in eval, a project import inside a function keeps torch or transformers off a --help path, and says so in a comment
  on its line; at most 20 of them;
- a function below a stage's entry takes the config sections it uses, typed: only the functions named in
  WHOLE_CONFIG (entries and dispatch points that read several sections) take the whole config, annotated `Config`;
  a parameter named `cfg` is always annotated.

Every import counts: at the top of a file, inside a function, and `importlib.import_module("eagle3ft....")`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOMS = ("eagle3ft.data", "eagle3ft.train", "eagle3ft.eval")  # above the shared modules, in this order
EVAL_JOBS = ("decode", "offline", "economics", "bench", "report")  # from the ground up
MAX_LINES = 450
SECTION = "\u00a7"  # the section sign, spelled by its code point so this file holds no citation of its own
LAB_NOTE = re.compile(SECTION + r"|\(records[,:] \"|\bH[12]00\b|\b20\d\d-[01]\d-[0-3]\d\b")
# the functions that take the whole config (annotated `Config`): a stage's entry, or a dispatch point reading several
# sections; every other function takes the sections it uses
WHOLE_CONFIG = frozenset(
    {
        # entries: a stage's run (and the worker a harvest starts), the resolved config written whole
        "data/harvest.py:run_harvest",
        "data/harvest.py:main.work",
        "data/magpie.py:run_magpie",
        "data/regen.py:run_regen",
        "data/regen.py:main.work",
        "eagle3ft/cli.py:save_resolved",
        "train/loop.py:run_training",
        "train/loop.py:setup",
        "train/metrics.py:open_wandb",  # the run's whole config, logged
        "train/validate.py:run",
        "eval/offline/accept_len.py:run",
        "eval/offline/compare.py:run",
        "eval/bench/live.py:run",
        "eval/bench/measure.py:run_offline",
        "eval/bench/measure.py:run_measure",
        "eval/report/demo_summary.py:run_headline",
        "eval/preflight.py:check_or_exit",  # every stage's preflight
        # dispatch: a backend or server built from the target, drafter, stage and serve sections, or the seed
        "eagle3ft/targets/sglang_server.py:build_command",
        "eagle3ft/targets/sglang_server.py:server_for",
        "eval/bench/live.py:make_backend",
        "eval/bench/embedded_backend.py:EmbeddedBackend.__init__",
        "eval/bench/sglang_backend.py:SGLangBackend.__init__",
        "train/data.py:TrainData.__init__",
        "train/dflash_objective.py:dflash_objective",
    }
)


def package_dirs(root: Path) -> dict[str, str]:
    """pyproject.toml's [tool.setuptools.package-dir] table (read by hand: tomllib is Python 3.11's)."""
    table = re.search(
        r"^\[tool\.setuptools\.package-dir\]\n((?:\"[^\"]+\" = \"[^\"]+\"\n?)+)",
        (root / "pyproject.toml").read_text(),
        re.M,
    )
    return dict(re.findall(r'"([^"]+)" = "([^"]+)"', table[1]))


def modules(root: Path) -> dict[str, Path]:
    """Module name -> file, as the package installs from this checkout (pyproject's package-dir)."""
    out: dict[str, Path] = {}
    for pkg, folder in sorted(package_dirs(root).items(), key=lambda kv: -len(Path(kv[1]).parts)):
        base = root / folder
        for f in sorted(base.rglob("*.py")):
            rel = f.relative_to(base)
            if not all((base / Path(*rel.parts[:i]) / "__init__.py").is_file() for i in range(1, len(rel.parts))):
                continue  # a plain folder below the package, not a subpackage
            parts = [pkg, *rel.parts[:-1]] + ([] if f.stem == "__init__" else [f.stem])
            out.setdefault(".".join(parts), f)
    return out


def imports(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports anywhere in it (a `from a.b import c` names a.b, and a.b.c when c is one)."""
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            out.add(n.module)
            out.update(f"{n.module}.{a.name}" for a in n.names)
        elif isinstance(n, ast.Import):
            out.update(a.name for a in n.names)
        elif (
            isinstance(n, ast.Call)
            and getattr(n.func, "attr", getattr(n.func, "id", "")) == "import_module"
            and n.args
            and isinstance(n.args[0], ast.Constant)
            and isinstance(n.args[0].value, str)
        ):
            out.add(n.args[0].value)
    return out & known


def graph(root: Path) -> dict[str, set[str]]:
    mods = modules(root)
    return {m: imports(f, set(mods)) - {m} for m, f in mods.items()}


def room(module: str) -> int:
    return next((i + 1 for i, r in enumerate(ROOMS) if module == r or module.startswith(r + ".")), 0)


def job(module: str) -> int | None:
    """None outside eval; 0 for eval's own files; 1.. for its jobs, from the ground up."""
    if room(module) != len(ROOMS):
        return None
    parts = module.split(".")
    return EVAL_JOBS.index(parts[2]) + 1 if len(parts) > 2 and parts[2] in EVAL_JOBS else 0


def upward_rooms(g: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, bs in g.items() for b in bs if room(b) > room(a))


def upward_jobs(g: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{a} -> {b}"
        for a, bs in g.items()
        for b in bs
        if job(a) is not None and job(b) is not None and job(b) > job(a)
    )


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for start in g:
        if start in index:
            continue
        work = [(start, iter(sorted(g[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(g[w]))))
            elif w in on:
                low[v] = min(low[v], index[w])
    return out


def long_files(root: Path) -> list[str]:
    out = []
    for f in modules(root).values():
        n = len(f.read_text().splitlines())
        if n > MAX_LINES:
            out.append(f"{f.relative_to(root)}: {n} lines")
    return sorted(out)


def lab_notes(root: Path) -> list[str]:
    """Lines of product code and shipped configs that cite a record, name a machine or give a date."""
    files = list(modules(root).values()) + sorted((root / "configs").rglob("*.yaml"))
    return [
        f"{f.relative_to(root)}:{i}: {line.strip()}"
        for f in files
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if LAB_NOTE.search(line)
    ]


def unexplained_local_imports(root: Path, under: str = "eagle3ft.eval") -> tuple[int, list[str]]:
    """(how many project imports sit inside functions of `under`'s modules, those without a comment on their line)."""
    count, bare = 0, []
    for m, f in modules(root).items():
        if not (m == under or m.startswith(under + ".")):
            continue
        lines = f.read_text().splitlines()
        functions = [n for n in ast.walk(ast.parse("\n".join(lines))) if isinstance(n, ast.FunctionDef)]
        inside = {n.lineno: n for fn in functions for n in ast.walk(fn) if isinstance(n, ast.ImportFrom)}
        for n in inside.values():
            if (n.module or "").startswith("eagle3ft"):
                count += 1
                if "#" not in lines[n.end_lineno - 1]:
                    bare.append(f"{f.relative_to(root)}:{n.lineno}")
    return count, sorted(bare)


def whole_config_functions(root: Path) -> tuple[list[str], list[str]]:
    """(product functions taking the whole config: a parameter annotated `Config`, or one named `cfg` with no
    annotation; those of them whose `cfg` has no annotation), each as `file:Class.function`."""
    whole, untyped = [], []

    def visit(node: ast.AST, where: str, prefix: str) -> None:
        for n in ast.iter_child_nodes(node):
            if isinstance(n, ast.ClassDef):
                visit(n, where, f"{prefix}{n.name}.")
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = n.args
                for p in a.posonlyargs + a.args + a.kwonlyargs:
                    ann = ast.unparse(p.annotation).strip("'\"") if p.annotation else None
                    if "Config" in (ann or "").replace(" ", "").split("|") or (p.arg == "cfg" and ann is None):
                        whole.append(f"{where}:{prefix}{n.name}")
                        if ann is None:
                            untyped.append(f"{where}:{prefix}{n.name}")
                visit(n, where, f"{prefix}{n.name}.")
            else:
                visit(n, where, prefix)

    for f in modules(root).values():
        visit(ast.parse(f.read_text()), str(f.relative_to(root)), "")
    return sorted(whole), sorted(untyped)


# --------------------------------------------------------------------------- this repository


def test_no_room_imports_one_above_it():
    g = graph(REPO)
    assert {room(m) for m in g} == {0, 1, 2, 3} and {job(m) for m in g} >= {0, 1, 2, 3, 4, 5}  # every room read
    assert upward_rooms(g) == []


def test_no_eval_job_imports_one_above_it():
    assert upward_jobs(graph(REPO)) == []


def test_no_import_circle():
    assert circles(graph(REPO)) == []


def test_no_product_file_over_450_lines():
    assert long_files(REPO) == []


def test_no_record_citation_machine_name_or_date_in_product_code_or_shipped_configs():
    assert lab_notes(REPO) == []


def test_functions_below_a_stage_entry_take_the_sections_they_use_typed():
    whole, untyped = whole_config_functions(REPO)
    assert untyped == [], "a parameter named cfg is annotated with what it is"
    assert sorted(set(whole) - WHOLE_CONFIG) == [], "take the config sections used, typed, or list it in WHOLE_CONFIG"
    assert len(whole) <= len(WHOLE_CONFIG) == 24


def test_evals_imports_inside_functions_are_few_and_each_says_why():
    count, bare = unexplained_local_imports(REPO)
    assert count <= 20 and bare == [], (count, bare)


# --------------------------------------------------------------------------- the rules themselves


def test_each_rule_names_what_breaks_it(tmp_path):
    """A small tree that breaks every rule once, inside functions too, is named by each check."""
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools.package-dir]\n"eagle3ft" = "eagle3ft"\n"eagle3ft.data" = "data"\n"eagle3ft.eval" = "eval"\n'
    )
    files = {
        "eagle3ft/__init__.py": "",
        "eagle3ft/shared.py": "def f():\n    from eagle3ft.data import store\n",  # a room above, in a function
        "data/__init__.py": "",
        "data/store.py": "import importlib\nimportlib.import_module('eagle3ft.data.other')\n",
        "data/other.py": "from eagle3ft.data import store\n" + "x = 1\n" * MAX_LINES,  # a circle, and too long
        "eval/__init__.py": "",
        "eval/offline/__init__.py": "",
        "eval/offline/compare.py": "def g():\n    from eagle3ft.eval.report.summary import h\n",  # a job above
        "eval/offline/why.py": "def k():\n    if 1:\n        from eagle3ft.data.store import x  # keeps torch off --help\n",
        "eval/report/__init__.py": "",
        "eval/report/summary.py": 'def h():\n    """as measured (' + 'records, "a title") on the H' + '200"""\n',
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "c.yaml").write_text(f"lr: 1  # RESULTS {SECTION}3, 2026-12-01\n")
    g = graph(tmp_path)
    assert upward_rooms(g) == ["eagle3ft.shared -> eagle3ft.data", "eagle3ft.shared -> eagle3ft.data.store"]
    assert upward_jobs(g) == ["eagle3ft.eval.offline.compare -> eagle3ft.eval.report.summary"]
    assert circles(g) == [["eagle3ft.data.other", "eagle3ft.data.store"]]
    assert long_files(tmp_path) == [f"data/other.py: {MAX_LINES + 1} lines"]
    assert [n.split(":")[0] for n in lab_notes(tmp_path)] == ["eval/report/summary.py", "configs/c.yaml"]
    assert unexplained_local_imports(tmp_path) == (2, ["eval/offline/compare.py:2"])


def test_the_whole_config_rule_names_what_breaks_it(tmp_path):
    """A function taking the whole config is named, typed or not (also as `Config | None`, or in a class); one taking
    sections, or a `cfg` that is another config, is not."""
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools.package-dir]\n"eagle3ft" = "eagle3ft"\n')
    (tmp_path / "eagle3ft").mkdir()
    (tmp_path / "eagle3ft" / "__init__.py").write_text("")
    (tmp_path / "eagle3ft" / "stage.py").write_text(
        "def entry(cfg: Config, run_dir): ...\n"
        "def below(cfg, n: int): ...\n"
        "class B:\n    def __init__(self, c: 'Config | None' = None): ...\n"
        "def narrow(bench: BenchConfig, serve: ServeConfig): ...\n"
        "def drafter(cfg: DrafterConfig): ...\n"
    )
    assert whole_config_functions(tmp_path) == (
        ["eagle3ft/stage.py:B.__init__", "eagle3ft/stage.py:below", "eagle3ft/stage.py:entry"],
        ["eagle3ft/stage.py:below"],
    )
