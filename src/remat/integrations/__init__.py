"""remat inside the training loops people use: ``remat.integrations.transformers.RematCallback`` for the
Hugging Face ``Trainer`` (``pip install 'remat[hf]'``) and ``remat.integrations.lightning.RematCallback``
for Lightning (``pip install 'remat[lightning]'``). Both plan on the first real training batch, with the
loop's own optimizer, precision and gradient accumulation, and apply the plan before the first step
(``remat.integrations.first_step``). ``torch.compile`` needs no integration: checkpoint first, then
compile (Note [Under torch.compile] in remat.rewrite).
"""
