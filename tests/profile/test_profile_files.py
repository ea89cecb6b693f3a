"""The profiler's writer under local attack (issue 23 items 6 and 9): no write through planted
links, private files and directories, directories others can write refused (also when
``ULTRACOMM_PROFILE`` is parsed), and a rerun into a used directory gets a fresh ``run<n>``."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
import torch

from ultracomm import Context, ExpertLayout, LoopbackDomain, Member, ReplicaPlan
from ultracomm.env import Config
from ultracomm.errors import ConfigError
from ultracomm.private_dir import PrivateDirError
from ultracomm.profile import Profiler, load_trace

ROOT = os.geteuid() == 0
NOBODY = 65534
LAYOUT = ExpertLayout((Member("w", (4,), torch.float32),))


def _record_two_steps(path) -> None:
    with Profiler(path, write_interval_s=0.0) as prof:
        for step in range(2):
            prof.record(0, load=np.full((2, 4), step + 1, np.int64))
            prof.step()


def test_planted_links_at_the_old_temporary_names_are_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    d = tmp_path / "trace"
    d.mkdir(mode=0o700)
    for name in ("index.json.tmp", "000000_step0.tmp", "000001_step1.tmp"):
        os.symlink(victim, d / name)
    _record_two_steps(d)
    assert victim.read_text() == "precious"
    tr = load_trace(d)
    assert tr["step"].tolist() == [0, 1] and tr["load"][1].tolist() == [[2] * 4] * 2
    written = sorted(p.name for p in d.iterdir() if not p.is_symlink())
    # the steps' files (one or two: the writer may batch them) and the index; no temporary left
    assert written[-1] == "index.json" and written[:-1] in (
        ["000000_step0-1.npz"],
        ["000000_step0.npz", "000001_step1.npz"],
    ), written
    assert sorted(p.name for p in d.iterdir() if p.is_symlink()) == [
        "000000_step0.tmp",
        "000001_step1.tmp",
        "index.json.tmp",
    ]
    for name in written:
        assert stat.S_IMODE(os.lstat(d / name).st_mode) == 0o600, name


def test_created_directories_are_0700(tmp_path):
    _record_two_steps(tmp_path / "a" / "b")
    for p in (tmp_path / "a", tmp_path / "a" / "b"):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o700


def test_a_link_at_the_index_name_is_a_trace_already(tmp_path):
    d = tmp_path / "t"
    d.mkdir(mode=0o700)
    os.symlink(tmp_path / "nowhere", d / "index.json")  # dangling: exists() says no, O_EXCL says yes
    with pytest.raises(ValueError) as ei:
        Profiler(d)
    assert str(ei.value) == (
        f"ultracomm.profile: {d} already holds a trace; pick another directory, remove it, or pass overwrite=True"
    )
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_group_or_world_writable_directory_refused(tmp_path, mode):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(PrivateDirError) as ei:
        Profiler(d)
    assert str(ei.value) == (
        f"ultracomm.profile: {d} is writable by its group or by everyone (mode {mode:04o}); "
        "give a directory only you can write (chmod go-w)"
    )
    assert list(d.iterdir()) == []  # refused before anything was written
    with pytest.raises(ConfigError) as ei:
        Config.from_env({"ULTRACOMM_PROFILE": str(d)})
    assert str(ei.value) == (
        f"ultracomm: ULTRACOMM_PROFILE={str(d)!r} is invalid: it is writable by its group or by everyone "
        f"(mode {mode:04o}); give a directory only you can write (chmod go-w) "
        "(config field profile)"
    )


@pytest.mark.skipif(not ROOT, reason="needs root to hand a directory to another user")
def test_directory_or_link_of_another_user_refused(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, NOBODY, NOBODY)
    with pytest.raises(PrivateDirError) as ei:
        Profiler(d)
    assert str(ei.value) == (
        f"ultracomm.profile: {d} is owned by uid {NOBODY}, not by this user (uid 0); give a directory you own"
    )
    with pytest.raises(ConfigError) as ei:
        Config.from_env({"ULTRACOMM_PROFILE": str(d)})
    assert str(ei.value) == (
        f"ultracomm: ULTRACOMM_PROFILE={str(d)!r} is invalid: it is owned by uid {NOBODY}, not by this "
        "user (uid 0); give a directory you own (config field profile)"
    )
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    link = tmp_path / "link"
    os.symlink(mine, link)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(PrivateDirError) as ei:
        Profiler(link)
    assert str(ei.value) == (
        f"ultracomm.profile: {link} is a symbolic link owned by uid {NOBODY}, not by this user "
        "(uid 0); give a directory you own"
    )
    assert list(mine.iterdir()) == []
    os.lchown(link, 0, 0)  # a link of one's own to one's own directory is fine
    _record_two_steps(link)
    assert load_trace(mine)["step"].tolist() == [0, 1]


def test_directory_of_another_user_refused_any_uid(tmp_path, monkeypatch):
    d = tmp_path / "t"
    d.mkdir(mode=0o700)
    me = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: me + 1)
    with pytest.raises(ConfigError) as ei:
        Config.from_env({"ULTRACOMM_PROFILE": str(d)})
    assert str(ei.value) == (
        f"ultracomm: ULTRACOMM_PROFILE={str(d)!r} is invalid: it is owned by uid {me}, not by this user "
        f"(uid {me + 1}); give a directory you own (config field profile)"
    )


@pytest.mark.parametrize(
    "value, why",
    [
        ("/dev/null", "it is not a directory; give a directory (created when missing)"),
        ("/dev/null/trace", "it cannot be created: /dev/null is not a directory"),
    ],
)
def test_profile_variable_names_a_non_directory_at_parse(value, why):
    with pytest.raises(ConfigError) as ei:
        Config.from_env({"ULTRACOMM_PROFILE": value})
    assert str(ei.value) == f"ultracomm: ULTRACOMM_PROFILE={value!r} is invalid: {why} (config field profile)"


def _run_job(world: int) -> None:
    plan_src = np.array([[1], [-1]], np.int32)[:world] if world == 2 else np.array([[-1]], np.int32)

    def body(group):
        with Context(group, LAYOUT, 1, 1, num_layers=1, num_workers=1) as ctx:
            ctx.register_masters(0, [torch.zeros((1, 4))], [torch.zeros((1, 4))])
            vid = ctx.begin(0)
            ctx.weight_sync(vid, ReplicaPlan.make(plan_src, experts_per_rank=1))
            ctx.end(vid)
        return True

    LoopbackDomain(world).run(body)


@pytest.mark.parametrize("world", [1, 2])
def test_rerun_gets_a_fresh_run_subdirectory(tmp_path, monkeypatch, world):
    base = tmp_path / "prof"
    monkeypatch.setenv("ULTRACOMM_PROFILE", str(base))
    for _ in range(3):
        _run_job(world)
    runs = [base, base / "run1", base / "run2"]
    for run in runs:
        dirs = [run / f"rank{r}" for r in range(world)] if world > 1 else [run]
        for d in dirs:
            assert (d / "index.json").is_file(), d
            assert len(load_trace(d)) == 1
    assert not (base / "run3").exists()


def test_context_profile_argument_refused_without_naming_the_variable(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)

    def body(group):
        with pytest.raises(PrivateDirError) as ei:
            Context(group, LAYOUT, 1, 1, num_layers=1, num_workers=1, profile=str(d))
        return str(ei.value)

    assert LoopbackDomain(1).run(body) == [
        f"ultracomm.profile: {d} is writable by its group or by everyone (mode 0777); give a directory only you "
        "can write (chmod go-w)"
    ]
