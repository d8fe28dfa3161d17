"""Directories and files only this user can read: where a service keeps what holds prompts or secrets (the
kvstore's disk tier: layer-0 V rows give every cached prompt token back to whoever reads them).

A directory is made 0700; an existing one is used only when it is a real directory (not a symlink) owned by
this user that nobody else can write (someone who could, could have planted a link or a file in it); one
merely readable by others is tightened to 0700. Files in it are opened with O_NOFOLLOW and mode 0600.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700


class UnsafeDirectory(RuntimeError):
    """A directory that someone else owns or can write, or a symlink: not used for private data."""


def user_cache_dir(*parts: str) -> Path:
    """$XDG_CACHE_HOME/<parts> (~/.cache/<parts> when unset), as the XDG base directory spec says."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root, *parts)


def private_dir(path: str | Path) -> Path:
    """`path` made (parents as usual) or checked as this user's private directory; UnsafeDirectory if it is not."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:  # made meanwhile: checked below like any existing one
            pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if os.path.islink(path):
            raise UnsafeDirectory(f"{path} is a symlink; give the real directory") from e
        raise UnsafeDirectory(f"{path} is not a directory this user can open: {e}") from e
    try:  # checked through the open descriptor: nothing can swap the directory between the check and the chmod
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise UnsafeDirectory(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UnsafeDirectory(f"{path} is writable by its group or by everyone "
                                  f"(mode {stat.S_IMODE(st.st_mode):o}); use a directory only you can write")
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, DIR_MODE)  # ours and only readable by others (an older kvmesh made it 0755)
    finally:
        os.close(fd)
    return path


def open_private(path: str | Path, flags: int) -> int:
    """os.open of a file that is not followed if it is a symlink, made 0600, and must be this user's own."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise UnsafeDirectory(f"{path} is not a regular file of this user")
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd
