"""The check (the last stage): a plan proved on real steps.

In: the model with a plan applied (:mod:`remat.rewrite`), the plain model, the inputs and the loop. Out: measured
steps (:mod:`~remat.check.steps`: peak and step time on one copy, or in place for sharded models) and the
equivalence of checkpointed and plain steps (:mod:`~remat.check.verify`: an ``EquivalenceReport``; gradients,
buffers and losses compared, exactly or within the compiled tolerance).

- ``steps``     real steps measured: peak and step time (measure_step)
- ``verify``    check_equivalence, assert_equivalent: plain vs checkpointed -> EquivalenceReport
- ``compare``   two steps taken and compared (exactly, or within Note [Compiled tolerance])
- ``slope``     Note [Is the gradient its own loss's?]: a difference told apart from a wrong gradient
- ``compiled``  Note [Compiled plans are proved]: a plan's compiled step against the plain compiled step
"""
