"""The array runtime, the lowest layer:

- ``device.py``: arrays on ``cpu`` (NumPy) or ``cuda`` (CuPy), page-locked host buffers, the
  compute lock.
- ``kernels.py``: operators with forward and backward, on either array module.
- ``conv_kernels.py``: the kernels of convolutional networks (convolution lowered to matrix
  products with its workspaces, pooling, batch normalisation, residual add, concatenation,
  flatten); not yet part of the training program.
- ``model.py``: the model description users write as JSON (layers, options), validated; the size
  limits; host inference.
- ``weights.py``: a model's stored weights (``.npz``), checked against its architecture.
- ``program.py``: the training program, the ordered operators of one iteration over named slots,
  which is also the job's access sequence, with lifetimes and recompute recipes.
- ``units.py``: the arena's allocation unit and rounding.
"""
