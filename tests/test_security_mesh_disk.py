"""The kvstore's disk tier keeps prompts (layer-0 V rows give every cached token back): attacked as another
local user would. The tests run as root here, and root reads any file whatever its mode, so the modes and
owners are checked with os.stat, and the read that must fail is made by a child process that has dropped to
the `nobody` user; the directory checks (someone else's directory, a group-writable one, symlinks) are made
against the real DiskTier."""
from __future__ import annotations

import os
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.kvstore import slab_file
from services.kvstore.disk_tier import SALT_TAG_FILE, DiskTier
from shared.private_dir import UnsafeDirectory
from shared.salt_tag import salt_tag
from tests.test_kvstore_disk import _chain

NOBODY = 65534


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def open_root() -> Iterator[Path]:
    """A directory every user can traverse (pytest's own tmp root is 0700, which would hide any mistake)."""
    root = Path(tempfile.mkdtemp(prefix="kvmesh-disk-sec-"))
    os.chmod(root, 0o755)
    try:
        yield root
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)


def _as_nobody_can_read(path: Path) -> bool:
    # coreutils' head, not this venv's python: `nobody` may not be able to run a python installed under /root
    r = subprocess.run(["head", "-c", "16", str(path)], user=NOBODY, group=NOBODY, extra_groups=[],
                       capture_output=True, timeout=30)
    assert r.returncode == 0 or b"Permission denied" in r.stderr, r.stderr
    return r.returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another user needs root")
def test_another_local_user_cannot_read_the_cached_prompts(open_root: Path) -> None:
    disk = DiskTier(open_root / "kvstore", 1 << 20, salt_tag=salt_tag("s1"))
    assert disk.put(_chain(3)).stored == 3
    slab = next((open_root / "kvstore").glob("blocks-*.slab"))
    assert _mode(open_root / "kvstore") == 0o700
    assert _mode(slab) == 0o600 and _mode(open_root / "kvstore" / SALT_TAG_FILE) == 0o600
    assert not _as_nobody_can_read(slab), "another user read the slab file's prompts"
    # The same file opened 0644 in the same directory would be readable: the check above can fail.
    os.chmod(open_root / "kvstore", 0o755)
    os.chmod(slab, 0o644)
    assert _as_nobody_can_read(slab)
    disk.close()
    # An older kvmesh left the directory 0755 and its file 0644: both are tightened at the next start.
    again = DiskTier(open_root / "kvstore", 1 << 20, salt_tag=salt_tag("s1"))
    again.put(_chain(1, start=9))
    assert _mode(open_root / "kvstore") == 0o700 and _mode(slab) == 0o600
    assert not _as_nobody_can_read(slab)
    assert again.stats().blocks == 4, "the records of the same salt are kept"
    again.close()


def test_a_directory_of_another_user_or_writable_by_others_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(UnsafeDirectory, match="belongs to uid 65534"):
        DiskTier(theirs, 1 << 20)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777 | stat.S_ISVTX)  # a /tmp-like directory: anyone may plant a link in it
    with pytest.raises(UnsafeDirectory, match="writable by its group or by everyone"):
        DiskTier(shared, 1 << 20)
    group = tmp_path / "group"
    group.mkdir()
    os.chmod(group, 0o770)
    with pytest.raises(UnsafeDirectory, match="writable"):
        DiskTier(group, 1 << 20)
    assert not list(theirs.iterdir()) and not list(shared.iterdir()) and not list(group.iterdir())


def test_symlinks_are_never_followed(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(UnsafeDirectory, match="symlink"):
        DiskTier(link, 1 << 20)
    # A link planted in place of the slab file: the file it points at is neither read nor written.
    victim = tmp_path / "victim"
    victim.write_bytes(b"do not touch" * 1000)
    disk_dir = tmp_path / "kv"
    disk = DiskTier(disk_dir, 1 << 20)
    disk.put(_chain(1))
    slab = next(disk_dir.glob("blocks-*.slab"))
    disk.close()
    slab.unlink()
    slab.symlink_to(victim)
    again = DiskTier(disk_dir, 1 << 20)
    assert again.stats().blocks == 0 and not slab.is_symlink()
    again.put(_chain(2, start=5))
    assert victim.read_bytes() == b"do not touch" * 1000
    assert stat.S_ISREG(os.lstat(slab).st_mode) and _mode(slab) == 0o600
    # And a link that appears between the scan and the open is refused by O_NOFOLLOW.
    again.close()
    layout = slab_file.SlabFile(disk_dir, 1 << 20, False, None)  # type: ignore[arg-type]
    slab.unlink()
    slab.symlink_to(victim)
    with pytest.raises(OSError):
        layout._open(int(slab.name[len("blocks-"):-len(".slab")]))
    assert victim.read_bytes() == b"do not touch" * 1000


def test_records_of_another_salt_are_wiped_at_start(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "kv", 1 << 20, salt_tag=salt_tag("old mesh secret"))
    disk.put(_chain(3))
    disk.close()
    same = DiskTier(tmp_path / "kv", 1 << 20, salt_tag=salt_tag("old mesh secret"))
    assert same.stats().blocks == 3 and same.wiped == 0
    same.close()
    (tmp_path / "kv" / "notes.txt").write_text("the user's own file")  # not the tier's: never touched
    new = DiskTier(tmp_path / "kv", 1 << 20, salt_tag=salt_tag("a new secret"))
    assert new.stats().blocks == 0 and new.wiped == 1
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == ["notes.txt", SALT_TAG_FILE], \
        "dead prompts left on disk"
    assert salt_tag("a new secret") not in ("a new secret", salt_tag("old mesh secret"))
