"""What a case is, with no backend: fp8 codecs, the geometry, the paged tensors, case building,
regions and the attention spec, the grouped planner (and its pad-fix), poison sites, the memory
budget. Importing this package imports nothing; its modules import torch where they need it."""
