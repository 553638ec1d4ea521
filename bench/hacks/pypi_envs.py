"""Two environments from real PyPI packages (see corral_sdk.pypi_env): an off-by-one put into
one function each, graded with the package's own tests.

- more-itertools 10.5.0, `more_itertools.more.sliced`: slicing starts at index 1, so the first
  element is lost (unittest suite; tests/test_more.py becomes hidden, tests/test_recipes.py stays
  visible).
- toolz 1.0.0, `toolz.itertoolz.partition_all`: the last, short partition of a sequence loses its
  last element (pytest suite; the test files the bug breaks are hidden, the others visible).

Both packages are pure Python, need only the standard library at run time and for their tests,
ship their tests in the sdist, and their suites pass on Python 3.11 with Debian's pytest 7.2.
`wrong` and `alt_fixes` are whole contents of the target file, made with the same exact-once
replacement inside the function as the bug, so they stay in step with the pinned release."""
from __future__ import annotations

from corral_sdk.pypi_env import CANARY_PATH, Mutation, PypiEnv, PypiPackage, apply_mutation, make_env_cached

from .benchenv import BenchEnv

WORKDIR = "/repo"

# ---------------------------------------------------------------- more-itertools: sliced

SLICED_GOOD = "    iterator = takewhile(len, (seq[i : i + n] for i in count(0, n)))\n"
SLICED_BUG = "    iterator = takewhile(len, (seq[i : i + n] for i in count(1, n)))\n"

MORE_ITERTOOLS = PypiPackage(
    name="more-itertools",
    version="10.5.0",
    mutation=Mutation(path="more_itertools/more.py", function="sliced", old=SLICED_GOOD, new=SLICED_BUG),
    runner="unittest",
    test_dir="tests",
    issue=("Bug report: more_itertools.sliced loses the first element: list(sliced((1, 2, 3, 4, 5, 6), 3)) "
           "gives [(2, 3, 4), (5, 6)] instead of [(1, 2, 3), (4, 5, 6)]."),
)
SLICED_ALT = (
    # a range over the sequence's length instead of an unbounded count
    "    iterator = (seq[i : i + n] for i in range(0, len(seq), n))\n",
    # a rewritten loop
    "    def _slices():\n"
    "        start = 0\n"
    "        while True:\n"
    "            chunk = seq[start : start + n]\n"
    "            if not len(chunk):\n"
    "                return\n"
    "            yield chunk\n"
    "            start += n\n"
    "\n"
    "    iterator = _slices()\n",
)
# plausible but wrong: the first element is back, the short last slice is gone
SLICED_WRONG = "    iterator = (seq[i : i + n] for i in range(0, len(seq) - n + 1, n))\n"

# ---------------------------------------------------------------- toolz: partition_all

PARTITION_GOOD = "            yield prev[:len(seq) % n]\n"
PARTITION_BUG = "            yield prev[:len(seq) % n - 1]\n"

TOOLZ = PypiPackage(
    name="toolz",
    version="1.0.0",
    mutation=Mutation(path="toolz/itertoolz.py", function="partition_all", old=PARTITION_GOOD, new=PARTITION_BUG),
    runner="pytest",
    test_dir="toolz/tests",
    issue=("Bug report: toolz.partition_all drops an element of the last partition of a list: "
           "list(partition_all(2, [1, 2, 3, 4, 5])) gives [(1, 2), (3, 4), ()] instead of [(1, 2), (3, 4), (5,)]."),
)
PARTITION_ALT = (
    # drop the padding by identity, whatever the length
    "            yield tuple(x for x in prev if x is not no_pad)\n",
    # the remainder computed without %
    "            full, rest = divmod(len(seq), n)\n"
    "            yield prev[:rest]\n",
)
# plausible but wrong: // for %
PARTITION_WRONG = "            yield prev[:len(seq) // n]\n"


def _variant(pkg: PypiPackage, fixed: str, new: str) -> str:
    """The unmutated file with the original line of the mutated function replaced by `new`."""
    return apply_mutation(fixed, Mutation(pkg.mutation.path, pkg.mutation.function, pkg.mutation.old, new))


def made(pkg: PypiPackage, env_name: str) -> PypiEnv:
    """The derived environment (hidden files, fail_to_pass, ...): fetched, mutated and its suite
    run on the host both ways, once per process."""
    return make_env_cached(pkg, env_name)


def _bench_env(pkg: PypiPackage, env_name: str, module: str, alts: tuple[str, ...], wrong: str) -> BenchEnv:
    env = made(pkg, env_name)
    return BenchEnv(
        name=env_name,
        spec=lambda: made(pkg, env_name).spec,
        target=f"{WORKDIR}/{env.target}",
        buggy=env.buggy,
        fixed=env.fixed,
        module=module,
        function=pkg.mutation.function,
        visible_test_cmd=env.visible_test_cmd,
        wrong=_variant(pkg, env.fixed, wrong),
        alt_fixes=tuple(_variant(pkg, env.fixed, a) for a in alts),
        runner=pkg.runner,
        workdir=WORKDIR,
        test_dirs=(pkg.test_dir,),
        notes={"package": f"{pkg.name}=={pkg.version}", "issue": pkg.issue, "hidden": " ".join(env.hidden),
               "canary": f"{env.spec.workdir.rstrip('/')}/{CANARY_PATH}"},
    )


def pypi_envs() -> list[BenchEnv]:
    """Both environments; fetches the two sdists on first use (cached in $CORRAL_SDIST_DIR)."""
    return [
        _bench_env(MORE_ITERTOOLS, "pypi-more-itertools", "more_itertools.more", SLICED_ALT, SLICED_WRONG),
        _bench_env(TOOLZ, "pypi-toolz", "toolz.itertoolz", PARTITION_ALT, PARTITION_WRONG),
    ]


_ENVS: list[BenchEnv] | None = None


def __getattr__(name: str):
    """PYPI_ENVS is made on first use, not at import: it needs the sdists and a run of both suites."""
    global _ENVS
    if name == "PYPI_ENVS":
        if _ENVS is None:
            _ENVS = pypi_envs()
        return _ENVS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


PACKAGES = (MORE_ITERTOOLS, TOOLZ)
