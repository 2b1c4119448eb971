"""The ops' tuning switches (csrc/tuning/overrides.h): read from the environment once per
process, set at runtime through flash_ext::set_tuning / get_tuning. No GPU needed."""

import os
import subprocess
import sys

import pytest
import torch

import flash_ext  # noqa: F401  (registers the ops)
from conftest import requires_ext

# The switches live in the compiled extension (the stand-in ops of an unbuilt tree have none).
pytestmark = requires_ext

SWITCHES = {  # name -> (default, another allowed value)
    "FLASH_EXT_FWD_PATH": ("auto", "sm80"),
    "FLASH_EXT_BWD_PATH": ("auto", "sm90"),
    "FLASH_EXT_SM90_PINGPONG": ("auto", "0"),
    "FLASH_EXT_SM90_STREAM_K": ("auto", "1"),
    "FLASH_EXT_SM90_FWD_TILE": ("auto", "alt"),
    "FLASH_EXT_BWD_VARIANT": ("2", "1"),
    "FLASH_EXT_BWD_SMALL_TILE": ("0", "1"),
    "FLASH_EXT_DECODE_RING": ("auto", "4"),
    "FLASH_EXT_SM90_BWD_GQA": ("auto", "loop"),
    "FLASH_EXT_SM90_BWD_LPT": ("auto", "1"),
    "FLASH_EXT_SM90_FM_FWD_SECTIONS": ("auto", "rule"),
    "FLASH_EXT_SM90_FM_FWD_TILES": ("auto", "scan"),
    "FLASH_EXT_DECODE_PDL": ("auto", "0"),
}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code, **env):
    """code in a fresh interpreter whose environment has no FLASH_EXT_* switch but `env`."""
    clean = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    clean.update(env)
    clean["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, clean.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", "import torch, flash_ext\nops = torch.ops.flash_ext\n" + code],
                          env=clean, capture_output=True, text=True, timeout=300)


def test_defaults_without_environment():
    code = "".join(f"print(ops.get_tuning({name!r}))\n" for name in SWITCHES)
    r = _run(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [default for default, _ in SWITCHES.values()]


@pytest.mark.parametrize("name", SWITCHES)
def test_set_and_restore(name, tuning):
    _, other = SWITCHES[name]
    before = tuning.get(name)
    tuning.set(name, other)
    assert tuning.get(name) == other
    tuning.set(name, "")  # the environment's value
    assert tuning.get(name) == before


def test_bad_value_is_an_error_naming_the_choices(tuning):
    with pytest.raises(RuntimeError, match="FLASH_EXT_SM90_FWD_TILE must be auto, base or alt; got 'huge'"):
        tuning.set("FLASH_EXT_SM90_FWD_TILE", "huge")
    with pytest.raises(RuntimeError, match="FLASH_EXT_SM90_PINGPONG must be auto, 0 or 1; got 'tile'"):
        tuning.set("FLASH_EXT_SM90_PINGPONG", "tile")
    with pytest.raises(RuntimeError, match="FLASH_EXT_FWD_PATH must be auto, sm80 or sm90"):
        tuning.set("FLASH_EXT_FWD_PATH", "sm100")
    with pytest.raises(RuntimeError, match="FLASH_EXT_DECODE_RING must be auto, 2, 3 or 4; got '8'"):
        tuning.set("FLASH_EXT_DECODE_RING", "8")


@pytest.mark.parametrize("name", ["FLASH_EXT_SM90_TMA_STORE", "FLASH_EXT_SM90_PERSISTENT",
                                  "FLASH_EXT_SM90_LAZY_RESCALE", "FLASH_EXT_SM90_ALIGN_END",
                                  "FLASH_EXT_SM90_HEAD_SECTIONS", "FLASH_EXT_SM90_SPEED"])
def test_unknown_or_removed_switch_is_an_error(name):
    with pytest.raises(RuntimeError, match=f"unknown tuning switch '{name}'; known: FLASH_EXT_FWD_PATH"):
        torch.ops.flash_ext.set_tuning(name, "1")


def test_environment_is_read_once_per_process():
    r = _run("import os\n"
             "print(ops.get_tuning('FLASH_EXT_SM90_FWD_TILE'))\n"
             "os.environ['FLASH_EXT_SM90_FWD_TILE'] = 'base'\n"  # after the first read: no effect
             "print(ops.get_tuning('FLASH_EXT_SM90_FWD_TILE'))\n"
             "ops.set_tuning('FLASH_EXT_SM90_FWD_TILE', 'base')\n"
             "print(ops.get_tuning('FLASH_EXT_SM90_FWD_TILE'))\n"
             "ops.set_tuning('FLASH_EXT_SM90_FWD_TILE', '')\n"  # back to the environment's value at startup
             "print(ops.get_tuning('FLASH_EXT_SM90_FWD_TILE'))\n",
             FLASH_EXT_SM90_FWD_TILE="alt")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["alt", "alt", "base", "alt"]


def test_bad_environment_value_is_an_error_at_first_use():
    r = _run("try:\n"
             "    ops.get_tuning('FLASH_EXT_FWD_PATH')\n"
             "except RuntimeError as e:\n"
             "    print('raised:', str(e).splitlines()[0])\n",
             FLASH_EXT_SM90_STREAM_K="yes")
    assert r.returncode == 0, r.stderr
    assert "raised: flash_ext: FLASH_EXT_SM90_STREAM_K must be auto, 0 or 1; got 'yes'" in r.stdout
