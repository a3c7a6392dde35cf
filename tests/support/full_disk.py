"""A full disk for the tests of writers: a stand-in for a save function
that fails the way a disk that fills up makes it fail."""

import errno
import os

# what torch's zip writer raises when the disk fills under it
TORCH_WRITE_FAILED = ("[enforce fail at inline_container.cc:783] . PytorchStreamWriter failed writing file data/3: "
                      "file write failed")
# what safetensors' save_file raises when the disk fills under it (seen on a 64 kB tmpfs)
SAFETENSORS_WRITE_FAILED = "Error while serializing: I/O error: No space left on device (os error 28)"


class FullDiskAt:
    """Wraps ``save(obj, path_or_file, ...)`` (``torch.save``,
    ``safetensors.torch.save_file``): the first ``call - 1`` calls go
    through; call ``call`` writes a few bytes to its destination and raises
    OSError ENOSPC (``error="ENOSPC"``), torch's RuntimeError (``"torch"``)
    or safetensors' SafetensorError (``"safetensors"``).
    ``calls`` lists every destination it was given."""

    def __init__(self, save, call: int, error: str = "ENOSPC"):
        self.save, self.call, self.error, self.calls = save, call, error, []

    def __call__(self, obj, destination, *args, **kwargs):
        self.calls.append(destination)
        if len(self.calls) < self.call:
            return self.save(obj, destination, *args, **kwargs)
        if hasattr(destination, "write"):
            destination.write(b"PK\x03\x04 partial")
        else:
            with open(destination, "wb") as f:
                f.write(b"PK\x03\x04 partial")
        if self.error == "ENOSPC":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if self.error == "safetensors":
            import safetensors

            raise safetensors.SafetensorError(SAFETENSORS_WRITE_FAILED)
        raise RuntimeError(TORCH_WRITE_FAILED)
