"""Several servers in one script: `DataParallel` (the batch split over servers, gradients
reduced server to server) and `pipeline` (a model's layers in stages over servers, micro-
batches through them). The implementation lives in the device's layer
(remote_accel.pytorch_ext.parallel, .pipeline); this module only names it, as
`remote_accel.parallel`, and importing it loads the device."""

from .pytorch_ext.parallel import DataParallel
from .pytorch_ext.pipeline import Pipeline, pipeline

__all__ = ["DataParallel", "Pipeline", "pipeline"]
