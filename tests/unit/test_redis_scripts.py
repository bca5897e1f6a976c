"""The Redis scripts are package data: read through importlib.resources, shipped in the
wheel, and ``ApplyArgs`` sends its fields in the order apply.lua names its ARGV slots."""

import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import fields
from importlib.resources import files
from pathlib import Path

from kvindex.redis_scripts import APPLY, ApplyArgs, holders

ROOT = Path(__file__).parents[2]


def test_apply_is_the_lua_file_read_through_importlib_resources():
    resource = files("kvindex").joinpath("lua", "apply.lua")
    assert APPLY == resource.read_text(encoding="utf-8")
    assert APPLY == (ROOT / "kvindex" / "lua" / "apply.lua").read_text(encoding="utf-8")


def test_apply_lua_binds_each_argv_slot_to_the_apply_args_field_of_that_position():
    bindings = re.findall(r"^local (\w+) = .*\bARGV\[(\d+)\]", APPLY, re.MULTILINE)
    assert {int(slot): name for name, slot in bindings} == {
        slot: field.name for slot, field in enumerate(fields(ApplyArgs), 1)
    }
    assert APPLY.count("ARGV[") == len(fields(ApplyArgs))  # no slot read by number elsewhere


def test_argv_lists_the_fields_in_declaration_order():
    names = [field.name for field in fields(ApplyArgs)]
    args = ApplyArgs(**{name: name for name in names})  # each field holds its own name
    assert args.argv() == tuple(names)


def test_the_first_name_is_the_first_name_len_bytes_of_names():
    args = ApplyArgs(
        op="S0", pod_id="abcdefgh", key_ttl_ms=1000, names=b"{k}:b:01{k}:b:02", name_len=8,
        extra=0, pod_name="pod-a", registry="{k}:pods", offsets="", anchors="", parents="",
        root="{k}:",
    )  # fmt: skip
    assert args.first_name == b"{k}:b:01"


def test_an_installed_wheel_ships_and_loads_the_lua(tmp_path):
    """Built as the Dockerfile builds it (``pip wheel``); imported straight from the
    wheel (zipimport), without site-packages or the source tree on the path."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "kvindex", src / "kvindex", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(src)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("kvgate-*.whl")
    assert "kvindex/lua/apply.lua" in zipfile.ZipFile(wheel).namelist()
    probe = "import kvindex.redis_scripts as r; print(r.__file__); print(len(r.APPLY))"
    done = subprocess.run(
        [sys.executable, "-S", "-c", probe], cwd=tmp_path, env={"PYTHONPATH": str(wheel)},
        check=True, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    module_file, length = done.stdout.split()
    assert module_file.startswith(str(wheel))
    assert int(length) == len(APPLY)


def test_holders_skip_entries_whose_number_int_would_refuse():
    # '²' passes str.isdigit(); 5000 digits exceed int()'s limit for strings
    value = "w|sup=²;long=" + "1" * 5000 + ";ok=1"

    assert holders(value.encode(), 0) == ({"ok": 1}, "w")


def test_holders_read_a_value_without_the_writer_separator_as_absent():
    assert holders(b"garbage", 0) == ({}, "")
