"""The array runtime, the lowest layer:

- ``device.py``: the device interface (arena buffer, views, copies and the swap engine's
  asynchronous ones, the clock) and ``cpu`` (NumPy, the compute lock); ``cuda.py``: ``cuda``
  (CuPy, copy streams, page-locked host buffers, CuPy's allocator routed into the arena);
  ``simulated.py``: ``sim`` (shapes on a virtual clock, :mod:`.gpus`' profiles);
  ``devices.py``: the devices by name.
- ``kernels.py``: operators with forward and backward, on either array module.
- ``conv_kernels.py``: the kernels of convolutional networks (convolution lowered to matrix
  products with its workspaces, pooling, batch normalisation, residual add, concatenation,
  flatten).
- ``network.py``: the layers of an architecture (JSON, validated) as a graph of nodes with
  shapes, weights and workspaces; inference of one node and of the whole network on the host.
- ``zoo.py``: published networks by name (VGG-16, ResNet-50, Inception-v3, DenseNet-121).
- ``model.py``: the model description users write as JSON (architecture, options), validated;
  the size limits; host inference with the stored scaling.
- ``weights.py``: a model's stored weights (``.npz``), checked against its architecture.
- ``program.py``: the training program, the ordered operators of one iteration over named slots,
  which is also the job's access sequence, with lifetimes and recompute recipes.
- ``builder.py``: the training program of a network: forward, loss, backward (gradients
  gathered over branches), optimizer steps.
- ``units.py``: the arena's allocation unit and rounding.
"""
