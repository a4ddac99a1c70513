"""What the suite reads from and writes to a user's disk (docs/configuration.md#what-a-command-writes).

- ``checkpoints``: the one reader of checkpoints. A file, a sharded folder, a bundle or a run folder is
  recognised, validated and loaded by one function for every mode and tool; nothing is unpickled except
  through ``torch.load(weights_only=True)`` or an allow-list.
- ``runs``: the one writer of run folders: where a command's outputs go, claimed only after its plan is valid,
  locked for the life of the process.
- ``atomic``: files and folders written whole or not at all (checkpoints, exports, reports).
"""
