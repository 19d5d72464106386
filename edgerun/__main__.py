from edgerun.cli import _entry

_entry()
