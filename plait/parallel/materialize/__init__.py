"""Models larger than one rank: build on the meta device, materialise only each rank's share (docs/startup.md).

- ``deferred_init(build, *args)``: the model on meta, its construction recorded (``record``);
- ``plait.parallelize`` materialises it after the pipeline split and the tp swaps, each rank only its share
  (``apply``), from a replay of the record (``replay``: bitwise the values of eager construction under the same
  seed) or from a ``WeightSource`` read rectangle by rectangle (``share``);
- ``materialize_module(model, weights)``: the same in one process, for the whole model.
"""

from plait.parallel.materialize.apply import is_meta_model, materialize_module
from plait.parallel.materialize.derive import deferred_init
from plait.parallel.materialize.replay import MaterializeError
from plait.parallel.materialize.share import WeightSource

__all__ = ["MaterializeError", "WeightSource", "deferred_init", "is_meta_model", "materialize_module"]
