"""Files written whole, under temporary names that no other file has.

A tool that writes ``target`` writes a temporary file beside it (the same
directory, so that the final rename is atomic) and renames it over
``target`` once it is complete. A fixed temporary name (``target.tmp``)
can be a file of the user's, the input itself say, which the write or the
cleanup then destroys; :func:`new_temporary` creates a name of its own
(``<target's name>.tmp-<random hex>``, created exclusively, as
``tempfile.mkstemp`` does, but with the permissions of any new file: the
umask's, where mkstemp's are the owner's alone), and the cleanup removes
only what it created.
"""

import contextlib
import os
import secrets


def new_temporary(target: str, directory: bool = False, suffix: str = "") -> str:
    """Create an empty file (``directory``: an empty directory) beside
    ``target``, under a name no file had, and return its path;
    ``suffix`` ends the name (a file format read from it, ``.png``).

    Raises:
        OSError: it cannot be created (a read-only or full file system).
    """
    parent, name = os.path.split(os.path.abspath(target))
    while True:
        path = os.path.join(parent, f"{name}.tmp-{secrets.token_hex(4)}{suffix}")
        try:
            if directory:
                os.mkdir(path, 0o777)
            else:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return path
        except FileExistsError:
            continue


@contextlib.contextmanager
def written_whole(target: str, suffix: str = ""):
    """Yield the path of a new temporary file beside ``target``
    (:func:`new_temporary`) to write; when the block ends without an error
    it is renamed over ``target``, otherwise removed (removed first: the
    space it took is free again before the error goes on).

    Raises:
        OSError: the temporary file cannot be created, or the rename fails.
    """
    partial = new_temporary(target, suffix=suffix)
    try:
        yield partial
        os.replace(partial, target)
    finally:
        if os.path.lexists(partial):
            os.remove(partial)


def umask() -> int:
    """This process's file-creation mask (read by setting it and setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def with_the_mode_of_a_new_file(path: str) -> None:
    """Give ``path`` the permissions any new file gets here (``0o666`` less
    the umask), where the library that wrote it chose its own (safetensors
    writes ``0o600``: the other users of a shared model directory could not
    read the weights)."""
    os.chmod(path, 0o666 & ~umask())
