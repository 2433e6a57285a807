"""Files that survive a crash: write, fsync, rename, fsync the directory.

A rename is atomic, but without fsync a crash (power loss, a killed VM) can
leave the new name pointing at an empty or partial file: the data and the
directory entry reach the disk in any order. Local paths get the full
sequence; paths with a scheme (``gs://``, ``hdfs://``) go through
`tf.io.gfile`, whose filesystems commit a file when it is closed.
"""

import os
import zlib

import tensorflow as tf

_CHUNK = 1 << 20


def is_local(path):
    return "://" not in str(path)


def fsync_file(path):
    if is_local(path):
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def fsync_dir(path):
    if is_local(path) and hasattr(os, "O_DIRECTORY"):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def replace(src, dst):
    """Renames `src` over `dst` after syncing `src`, then syncs the directory."""
    fsync_file(src)
    tf.io.gfile.rename(src, dst, overwrite=True)
    fsync_dir(os.path.dirname(dst) or ".")


def write_atomic(path, text):
    """Writes `text` to `path`: a reader sees the old file or the whole new one."""
    tmp = f"{path}.tmp"
    with tf.io.gfile.GFile(tmp, "w") as f:
        f.write(text)
    replace(tmp, path)


def checksum(path):
    """``(size in bytes, crc32)`` of the file at `path`."""
    crc, size = 0, 0
    with tf.io.gfile.GFile(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def listdir(path):
    """File names in `path` (no glob: the path may contain ``[``, ``*``, ``?``)."""
    if not tf.io.gfile.isdir(path):
        return []
    return [name.rstrip("/") for name in tf.io.gfile.listdir(path)]


def remove(path):
    if tf.io.gfile.exists(path):
        tf.io.gfile.remove(path)
