"""target/: plan a run that is not here -- a device from the table (or your own spec) and a world size -- from
this machine, without running the step (issue #39).

The second implementation of where costs come from (Note [Where costs come from] in remat.api.source):

- ``devices``  built-in specs of training GPUs, each figure with its source; your own as JSON -> DeviceSpec
- ``world``    Target (device, world, FSDP/TP) -> the model copied onto fake tensors, parallelized on torch's fake
               process group at the target's world size, the batch from shapes (Note [Fake CUDA on a CPU build])
- ``source``   ModelledTarget: the step recorded there -> Profile; plans checked by replaying the CUDA caching
               allocator (remat.costs.allocator) -> Plan with its predicted reserved peak (Note [Target kernels])
- ``limits``   what planning on fake tensors cannot do -> an UnsupportedError naming it (Note [Limits of fake tensors])
- ``tradeoff`` plans per budget and the hand rules, each predicted for the target -> PredictedRow

In: a Target and the user's model (on the meta device or anywhere; never changed) and example inputs (shapes). Out:
a Profile and Plans, every figure predicted for the target, not measured.
"""

from remat.target.devices import KNOWN, DeviceSpec
from remat.target.spec_file import device_spec
from remat.target.source import ModelledTarget
from remat.target.world import Target

__all__ = ["DeviceSpec", "KNOWN", "ModelledTarget", "Target", "device_spec"]
