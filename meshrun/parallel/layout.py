"""Compatibility names for `meshrun.parallel.placement`: where a rank's local parameter sits in
the global (unsharded) tensor.

`pieces(param)`, `global_shape(param)`, `sharded_over(param)` and `Piece` read the parameter's
placement record (one per parameter, written by the strategies that cut it); see that module.
"""

from meshrun.parallel.placement import Piece, global_shape, pieces, sharded_over

__all__ = ["Piece", "global_shape", "pieces", "sharded_over"]
