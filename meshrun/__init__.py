"""meshrun: a torchrun-compatible elastic launcher and a worker-side parallelism library.

``meshrun.launcher`` parses the command line, ``meshrun.agent`` runs one node's workers,
``meshrun.rendezvous`` decides membership, and ``meshrun.parallel`` is imported by the
training scripts. Importing ``meshrun`` itself imports nothing heavy (no torch).
"""

__version__ = "0.1.0"
