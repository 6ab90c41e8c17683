"""The storage engine under the checkpoint API: the on-disk format (format.py, index_parts.py,
safetensors_io.py, checksum.py, seal.py), the byte movers (transfer.py, direct_io.py, boxes.py),
the atomic commit (commit.py) and the checks on untrusted files (untrusted.py). Nothing here
knows about models or training; reader.py and writer.py one level up are its only callers."""
