"""A recorded stand-in of the ``flashinfer`` package for tests/stacks (FlashInfer needs CUDA).

Only what vLLM 0.33.0's all-reduce + norm fusion imports from it: ``flashinfer.comm``
(``allreduce_fusion``, ``create_allreduce_fusion_workspace``, ``AllReduceFusionPattern``,
``QuantizationSFLayout``) and ``flashinfer.comm.mnnvl.TorchDistBackend``. Put on ``sys.path`` by a
test's ranks only (tests/stacks/stubs.py: ``use_flashinfer_stand_in``), so vLLM's own fusion module
registers its real op, its pass builds its real workspace and patterns, and the op's calls land in
``flashinfer.comm.allreduce_fusion`` here. Listed in stubs.STAND_INS.
"""

__version__ = "0.0.0+autosymm-stand-in"

__stand_in__ = True
