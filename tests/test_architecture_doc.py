"""docs/architecture.md stays true: every path and every ``module.symbol`` it names in backticks exists, the import
rules of its "The layers" section hold for every hf_dp module (no cycle; each layer imports only what the page allows),
and its list of private Trainer methods DPTrainer overrides is ``hf_dp.trainer.HF_PRIVATE_OVERRIDES``."""

from __future__ import annotations

import importlib
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "architecture.md")
PATH_RE = re.compile(r"^(hf_dp|tests|docs|benchmarks|recipes|model_cards)/[\w./-]*$")
NAME_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
CHECKED_ROOTS = ("hf_dp", "DPTrainer", "opacus")


def _spans() -> list[str]:
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # the layer diagram is not a list of names
    return re.findall(r"`([^`\n]+)`", text)


def _paths() -> list[str]:
    return sorted({s for s in _spans() if PATH_RE.match(s)})


def _names() -> list[str]:
    return sorted({s for s in _spans() if NAME_RE.match(s) and s.split(".")[0] in CHECKED_ROOTS})


def _resolve(name: str):
    parts = name.split(".")
    if parts[0] == "DPTrainer":
        obj = importlib.import_module("hf_dp.trainer").DPTrainer
        for attr in parts[1:]:
            obj = getattr(obj, attr)
        return obj
    for cut in range(len(parts), 0, -1):  # the longest importable module prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


def test_the_doc_names_enough_to_be_checked():
    assert len(_paths()) >= 20 and len(_names()) >= 30


@pytest.mark.parametrize("path", _paths())
def test_every_path_exists(path):
    assert os.path.exists(os.path.join(ROOT, path)), f"docs/architecture.md names {path}, which does not exist"


@pytest.mark.parametrize("name", _names())
def test_every_module_symbol_exists(name):
    try:
        _resolve(name)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"docs/architecture.md names `{name}`, which does not resolve: {e}")


# --------------------------------------------------------------------------------------------------- import contracts
# The rules of the page's "The layers" section, as data. Imports are read from the source (ast), at module level and
# inside functions alike. A name imported from a package (``from hf_dp.models import check_trainable``) counts as an
# import of the module that defines it (``hf_dp.models.freezing``); a name defined in a package's ``__init__.py`` itself
# (``hf_dp.__version__``) as an import of the package. A package's ``__init__.py`` imports its own modules: it is not
# a node of the cycle check (Python runs it before any module of the package anyway).
# A pattern is a module (``hf_dp.flags``), or ``pkg.*``: the package ``pkg`` and every module under it.
MODULE_LEVEL, ANYWHERE = "module level", "anywhere"
MAY_IMPORT = [
    # (importers, where the import is, what of hf_dp they may import: nothing else)
    ("hf_dp.arguments", ANYWHERE,
     ["hf_dp.flags", "hf_dp.optim.registry", "hf_dp.models.freezing", "hf_dp.models.precision",
      "hf_dp.privacy.accounting"]),
    ("hf_dp.flags", ANYWHERE, []),
    ("hf_dp.optim.*", MODULE_LEVEL, ["hf_dp.optim.*"]),
    ("hf_dp.privacy.*", ANYWHERE, ["hf_dp.privacy.*", "hf_dp.optim.base"]),
    ("hf_dp.models.*", ANYWHERE, ["hf_dp.models.*"]),
    # (clipping.sharding, FSDP2 under DP, reads which update rules have a per-sample affine map: refused under FSDP)
    ("hf_dp.clipping.*", ANYWHERE, ["hf_dp.clipping.*", "hf_dp.models.*", "hf_dp.optim.registry", "hf_dp.optim.base"]),
    ("hf_dp.hub.*", ANYWHERE, ["hf_dp.hub.*", "hf_dp", "hf_dp.privacy.randomness"]),
    # what keeps one run honest: below the trainer (which hands it itself as an argument), above the models, the
    # sampler and the accountant; only the set-up (the mechanism planned once) reaches the planner, the engines and the
    # update rules, only the saved model folder reaches the hooks' unwrapping
    ("hf_dp.run.*", ANYWHERE, ["hf_dp.run.*", "hf_dp", "hf_dp.flags", "hf_dp.models.*", "hf_dp.privacy.*",
                               "hf_dp.clipping.*", "hf_dp.optim.registry", "hf_dp.optim.build", "hf_dp.plan.*"]),
    ("hf_dp.run.contract", ANYWHERE, ["hf_dp.run.independence", "hf_dp.flags", "hf_dp.models.*"]),
    ("hf_dp.run.independence", ANYWHERE, ["hf_dp.models.*"]),
    ("hf_dp.run.data", ANYWHERE, ["hf_dp.run.contract", "hf_dp.models.*", "hf_dp.privacy.sampler",
                                  "hf_dp.clipping.sharding", "hf_dp.run.draws"]),
    ("hf_dp.run.draws", ANYWHERE, ["hf_dp.privacy.sampler"]),
    ("hf_dp.run.release", ANYWHERE, ["hf_dp.clipping.sharding", "hf_dp.clipping.hooks"]),
    ("hf_dp.run.checkpointing", ANYWHERE, ["hf_dp", "hf_dp.privacy.accounting"]),  # hf_dp.__version__ in the marker
    ("hf_dp.run.spent", ANYWHERE, ["hf_dp.run.checkpointing"]),
    ("hf_dp.run.lineage", ANYWHERE, ["hf_dp.run.checkpointing", "hf_dp.run.spent", "hf_dp.privacy.accounting"]),
    # the planner: public quantities through the accountant and the sampler's steps; d counted by --trainable's rule;
    # the banded factor's coefficients for --noise_comparison (hf_dp.plan.noise)
    ("hf_dp.plan.*", ANYWHERE, ["hf_dp.plan.*", "hf_dp.privacy.accounting", "hf_dp.privacy.sampler",
                                "hf_dp.privacy.banded", "hf_dp.models.freezing"]),
    ("hf_dp.plan.calibration", ANYWHERE, []),
    ("hf_dp.plan.lm_verdict", ANYWHERE, []),
    ("hf_dp.tuning.*", ANYWHERE, ["hf_dp.tuning.*", "hf_dp.privacy.selection", "hf_dp.privacy.randomness",
                                  "hf_dp.run.data", "hf_dp.run.lineage"]),
    # the audits sit on top of the library: they drive the mechanism or DPTrainer; nothing below imports them
    ("hf_dp.audit.*", ANYWHERE, ["hf_dp.audit.*", "hf_dp.arguments", "hf_dp.trainer", "hf_dp.run.contract",
                                 "hf_dp.run.data", "hf_dp.clipping.hooks", "hf_dp.optim.*", "hf_dp.privacy.*"]),
    ("hf_dp.audit.stats", ANYWHERE, []),
    # the trainer imports it (--audit_canaries): it takes the trainer as an argument; the one-run audit's pure modules,
    # and the row-tagging wrapper the loader reads (run.data.TaggedRows)
    ("hf_dp.audit.canaries", ANYWHERE, ["hf_dp.audit.one_run_bound", "hf_dp.audit.fdp", "hf_dp.audit.canary_kinds",
                                        "hf_dp.audit.lm_canaries", "hf_dp.audit.stats", "hf_dp.audit.canary_rows",
                                        "hf_dp.run.data"]),
    ("hf_dp.audit.canary_rows", ANYWHERE, ["hf_dp.run.data"]),
    ("hf_dp.audit.lm_canaries", ANYWHERE, ["hf_dp.audit.canary_kinds"]),
    ("hf_dp.audit.one_run_bound", ANYWHERE, ["hf_dp.audit.stats"]),
    ("hf_dp.audit.fdp", ANYWHERE, ["hf_dp.audit.one_run_bound"]),
    ("hf_dp.audit.canary_kinds", ANYWHERE, []),
    # DP SFT with TRL (the sft extra): on top of the trainer, beside the audits; nothing below imports it
    ("hf_dp.sft.*", ANYWHERE, ["hf_dp.sft.*", "hf_dp.trainer", "hf_dp.arguments", "hf_dp.flags", "hf_dp.run.data",
                               "hf_dp.models.precision", "hf_dp.hub.*"]),
    # DP preference tuning with TRL (DPO, reward models): beside DP SFT; it drives DPTrainer's step (hf_dp.run.step)
    # with a per-pair objective built on the per-example losses' registry (hf_dp.models.loss)
    ("hf_dp.dpo.*", ANYWHERE, ["hf_dp.dpo.*", "hf_dp.trainer", "hf_dp.arguments", "hf_dp.flags", "hf_dp.run.data",
                               "hf_dp.run.step", "hf_dp.models.loss", "hf_dp.models.precision", "hf_dp.hub.*"]),
]
# modules of hf_dp that only the listed importers may import
ONLY_IMPORTED_BY = {
    "hf_dp.trainer": ["hf_dp", "hf_dp.audit.trainer_path", "hf_dp.sft.trainer", "hf_dp.dpo.trainer",
                      "hf_dp.dpo.reward"],  # the package's lazy `hf_dp.DPTrainer`; the audit's trainer path; the TRL trainers
    "hf_dp.sft.trainer": ["hf_dp.sft"],  # the sft package re-exports DPSFTTrainer; nothing else in hf_dp imports TRL's side
    "hf_dp.dpo.trainer": ["hf_dp.dpo", "hf_dp.dpo.reward"],  # the dpo package re-exports DPDPOTrainer
    "hf_dp.dpo.reward": ["hf_dp.dpo"],  # and DPRewardTrainer
}
# top-level packages of this repository that nothing in hf_dp imports
NEVER_IMPORTED = ("recipes", "benchmarks", "tests")


def _module_files() -> dict[str, str]:
    out = {}
    for folder, _dirs, files in os.walk(os.path.join(ROOT, "hf_dp")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                mod = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[mod[: -len(".__init__")] if mod.endswith(".__init__") else mod] = path
    return out


MODULES = _module_files()
PACKAGES = {m for m, p in MODULES.items() if p.endswith("__init__.py")}


def _raw_imports(module: str) -> list[tuple[str, str | None, bool]]:
    """``(imported module, name or None, at module level)`` for every import statement of ``module``."""
    import ast

    with open(MODULES[module], encoding="utf-8") as f:
        tree = ast.parse(f.read())
    package = module if module in PACKAGES else module.rpartition(".")[0]
    out = []

    def visit(node, top: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.extend((a.name, None, top) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(parts + ([child.module] if child.module else []))
                out.extend((base, a.name, top) for a in child.names)
            visit(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, True)
    return out


def _reexports(package: str) -> dict[str, str]:
    """Names a package's ``__init__.py`` imports from its modules (at any depth: ``hf_dp.__getattr__`` imports
    lazily)."""
    out = {}
    for base, name, _top in _raw_imports(package):
        if name is not None and base.startswith(package + "."):
            out[name] = _resolve_import(base, name)
    return out


def _resolve_import(base: str, name: str | None) -> str:
    """The hf_dp module an import statement depends on (see the comment above MAY_IMPORT)."""
    if name is not None and f"{base}.{name}" in MODULES:
        return f"{base}.{name}"
    if name is not None and base in PACKAGES:
        target = _reexports(base).get(name)
        if target is not None:
            return target
    while base not in MODULES and "." in base:
        base = base.rpartition(".")[0]
    return base


def _imports(module: str, level: str = ANYWHERE) -> set[str]:
    """What of hf_dp (and of this repository's other top-level packages) ``module`` imports."""
    roots = ("hf_dp",) + NEVER_IMPORTED
    return {
        _resolve_import(base, name) if base.split(".")[0] == "hf_dp" else base
        for base, name, top in _raw_imports(module)
        if base.split(".")[0] in roots and (top or level == ANYWHERE)
    } - {module}


def _matches(module: str, pattern: str) -> bool:
    if pattern.endswith(".*"):
        return module == pattern[:-2] or module.startswith(pattern[:-1])
    return module == pattern


def test_the_import_rules_name_existing_modules():
    patterns = [p for who, _, allowed in MAY_IMPORT for p in [who, *allowed]] + list(ONLY_IMPORTED_BY)
    patterns += [p for allowed in ONLY_IMPORTED_BY.values() for p in allowed]
    for pattern in patterns:
        assert any(_matches(m, pattern) for m in MODULES), f"the import rules name {pattern}, which matches no module"
    assert "hf_dp.optim.base" in _imports("hf_dp.privacy.privatizer")  # the parser sees what it should
    assert "hf_dp.models.freezing" in _imports("hf_dp.arguments")  # a package's re-export: the defining module
    assert "hf_dp.trainer" in _imports("hf_dp.audit.trainer_path")  # inside a function
    assert "hf_dp.trainer" not in _imports("hf_dp.audit.trainer_path", MODULE_LEVEL)


@pytest.mark.parametrize("who,level,allowed", MAY_IMPORT, ids=[r[0] for r in MAY_IMPORT])
def test_each_layer_imports_only_what_the_page_allows(who, level, allowed):
    bad = {
        (module, imported)
        for module in MODULES if _matches(module, who)
        for imported in _imports(module, level)
        if not any(_matches(imported, p) for p in allowed)
    }
    assert not bad, (f"docs/architecture.md ('The layers'): {who} may import only {allowed or 'nothing of hf_dp'} "
                     f"({level}); found {sorted(bad)}")


def test_only_the_listed_modules_import_the_trainer_and_none_imports_the_recipes():
    for target, allowed in ONLY_IMPORTED_BY.items():
        importers = sorted(m for m in MODULES if target in _imports(m))
        assert set(importers) <= set(allowed), f"{target} is imported by {importers}; the page allows only {allowed}"
    for module in MODULES:
        outside = sorted(i for i in _imports(module) if i.split(".")[0] in NEVER_IMPORTED)
        assert not outside, f"{module} imports {outside}: the library must not depend on {NEVER_IMPORTED}"


def test_no_import_cycle_among_hf_dp_modules():
    graph = {m: {i for i in _imports(m) if i in MODULES and i not in PACKAGES} for m in MODULES if m not in PACKAGES}
    cycles, state, stack = [], {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles (module-level and function-level imports alike): " + "; ".join(
        " -> ".join(c) for c in cycles)



# ------------------------------------------------------------------------------------------------- module size
MAX_LINES = 550  # a module past this is split along its seam in the change that grew it (issue 43)
DATA_TABLES = {"hf_dp.flags"}  # tables of data, not code: exempt


def test_no_module_is_longer_than_the_limit():
    long = {}
    for module, path in MODULES.items():
        with open(path, encoding="utf-8") as f:
            lines = sum(1 for _ in f)
        if lines > MAX_LINES and module not in DATA_TABLES:
            long[module] = lines
    assert not long, f"modules over {MAX_LINES} lines (split each along its seam): {long}"


# ------------------------------------------------------------------------------------------- private HF overrides
NUMBER_WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}


def test_the_page_lists_every_private_hf_override():
    """The paragraph naming ``hf_dp.trainer.HF_PRIVATE_OVERRIDES`` lists exactly its methods (as ``DPTrainer._x``) and
    says how many there are."""
    from hf_dp.trainer import HF_PRIVATE_OVERRIDES

    with open(DOC, encoding="utf-8") as f:
        paragraphs = f.read().split("\n\n")
    [paragraph] = [p for p in paragraphs if "`hf_dp.trainer.HF_PRIVATE_OVERRIDES`" in p]
    listed = re.findall(r"`DPTrainer\.(_\w+)`", paragraph)
    assert sorted(listed) == sorted(HF_PRIVATE_OVERRIDES), (listed, sorted(HF_PRIVATE_OVERRIDES))
    assert f"{NUMBER_WORDS[len(HF_PRIVATE_OVERRIDES)]} private" in paragraph
