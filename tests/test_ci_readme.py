"""README's install and test commands, read the way CI reads them (.ci/readme_commands.py): the
marked blocks exist, CI runs them, and the install command installs what the test command needs
(the `test` extra of setup.py, which covers the tests' third-party imports)."""

import ast
import importlib.util
import os
import re
import shlex
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_parser():
    spec = importlib.util.spec_from_file_location(
        "readme_commands", os.path.join(ROOT, ".ci", "readme_commands.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


rc = _load_parser()


def _read(*parts):
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def _words(cmd):
    """Each simple command of a shell line (split at && / || / ; / |) as its words."""
    return [shlex.split(part) for part in re.split(r"&&|\|\||;|\|", cmd) if part.strip()]


def _installed_extras(cmds):
    """{extra} of every `pip install ... .[extra,...]` of the local project in the commands."""
    extras = set()
    for cmd in cmds:
        for words in _words(cmd):
            if words[:2] == ["pip", "install"] or words[1:4] == ["-m", "pip", "install"]:
                for w in words:
                    m = re.fullmatch(r"\.\[([\w,\- ]+)\]", w)
                    if m:
                        extras |= {e.strip() for e in m.group(1).split(",")}
    return extras


def _setup_extras():
    """setup.py's extras_require, read without running setup.py (it imports torch and builds)."""
    tree = ast.parse(_read("setup.py"))
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no extras_require")


README = _read("README.md")


def test_readme_blocks_exist_in_order():
    blocks = rc.marked_blocks(README)
    assert set(blocks) >= {"install", "test"}
    assert README.index("<!-- ci: install -->") < README.index("<!-- ci: test -->")


def test_install_command_installs_the_test_extra():
    cmds = rc.block_commands(README, "install")
    assert "test" in _installed_extras(cmds), cmds
    # torch first (the build imports it), then the package without build isolation
    flat = [w for c in cmds for words in _words(c) for w in words]
    assert "torch" in flat and "--no-build-isolation" in flat
    assert flat.index("torch") < flat.index("--no-build-isolation")


def test_test_commands_build_in_place_and_run_pytest():
    cmds = rc.block_commands(README, "test")
    words = [w for c in cmds for w in _words(c)]
    assert any(w[:2] == ["python", "setup.py"] and "--inplace" in w for w in words), cmds
    assert any(w[:3] == ["python", "-m", "pytest"] and "tests" in w for w in words), cmds


def test_test_extra_covers_the_tests_imports():
    extras = _setup_extras()
    assert "pytest" in extras["test"] and "matplotlib" in extras["bench"]
    if not hasattr(sys, "stdlib_module_names"):
        pytest.skip("needs sys.stdlib_module_names (Python >= 3.10)")
    test_dir = os.path.join(ROOT, "tests")
    local = {os.path.splitext(f)[0] for d in ("tests", "tools", "build_support")
             for f in os.listdir(os.path.join(ROOT, d)) if f.endswith(".py")}
    provided = {re.split(r"[<>=!~\[ ;]", r)[0].lower().replace("-", "_") for r in extras["test"]}
    known = set(sys.stdlib_module_names) | local | {"torch", "flash_ext", "functorch"} | provided
    missing = {}
    for name in sorted(os.listdir(test_dir)):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(_read("tests", name))
        for node in tree.body:  # module-level imports: the ones that fail collection
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0
                    else [])
            for m in mods:
                if m.split(".")[0] not in known:
                    missing.setdefault(m.split(".")[0], []).append(name)
    assert not missing, f"tests import modules that the test extra does not install: {missing}"


def test_ci_runs_the_readme_blocks():
    ci = _read(".ci", "run")
    for name in ("install", "test"):
        assert f"python3 .ci/readme_commands.py README.md {name}" in ci
    assert "FLASH_EXT_TESTS_REQUIRE_EXT=1" in ci and "source \"$VENV_DIR/bin/activate\"" in ci


def test_parser():
    text = "\n".join([
        "intro", "<!-- ci: install -->", "", "```bash", "pip install a \\", "  b  # two", "",
        "# a comment", "echo 'x && y'", "```", "<!--ci:test-->", "~~~sh", "make test", "~~~", "tail"])
    assert rc.block_commands(text, "install") == ["pip install a    b  # two", "echo 'x && y'"]
    assert rc.block_commands(text, "test") == ["make test"]
    with pytest.raises(rc.ReadmeBlockError, match="no '<!-- ci: other -->' block"):
        rc.block_commands(text, "other")
    with pytest.raises(rc.ReadmeBlockError, match="more than once"):
        rc.marked_blocks(text + "\n<!-- ci: test -->\n```\nx\n```")
    with pytest.raises(rc.ReadmeBlockError, match="not followed by a fenced code block"):
        rc.marked_blocks("<!-- ci: install -->\npip install x\n")
    with pytest.raises(rc.ReadmeBlockError, match="not closed"):
        rc.marked_blocks("<!-- ci: install -->\n```\npip install x\n")
    with pytest.raises(rc.ReadmeBlockError, match="has no command"):
        rc.block_commands("<!-- ci: install -->\n```\n# nothing\n```", "install")


def test_installed_extras_helper():
    assert _installed_extras(['pip install torch && pip install --no-build-isolation ".[test,bench]"']) \
        == {"test", "bench"}
    assert _installed_extras(["python -m pip install '.[test]'"]) == {"test"}
    assert _installed_extras(["pip install --no-build-isolation ."]) == set()


def test_main_prints_commands(capsys, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("<!-- ci: test -->\n```bash\npython -m pytest -q tests\n```\n")
    assert rc.main([str(readme), "test"]) == 0
    assert capsys.readouterr().out == "python -m pytest -q tests\n"
    assert rc.main([str(readme), "install"]) == 1
    assert "no '<!-- ci: install -->' block" in capsys.readouterr().err
