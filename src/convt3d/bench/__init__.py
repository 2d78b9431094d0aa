"""``convt3d bench``: the measuring stick every performance claim of convt3d comes from (``.cli``
for the options; nothing heavy is imported here)."""
