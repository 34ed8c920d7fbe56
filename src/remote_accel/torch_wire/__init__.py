"""remote_accel.torch_wire: torch values in message fields, shared by client and server.

The layer between the device and the server above it and the torch-free data plane below:
`values` turns op arguments (tensors, dtypes, devices, generators) into `dataplane.codec`
values and back. It is the one place below pytorch_ext and server that imports torch.
"""
