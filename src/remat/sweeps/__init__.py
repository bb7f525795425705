"""Features built on the pipeline that plan and measure many steps: the CLI's tradeoff tables, the largest batch and
the accuracy check.

- ``report``  model + budgets -> TradeoffRow per strategy and budget: hand rules and remat's plan, each measured
- ``compiled``  the same table for a compiled loop (peaks and times of compiled steps)
- ``rows``  the table's rows (TradeoffRow), the budgets swept, the row of a budget no plan meets
- ``sizing``  budget + make_batch(n) -> BatchSizeReport: the largest and the fastest batch (or sequence) size
  under a budget, confirmed on real steps
- ``search``  the sizes searched on fitted profiles (SizeRow, BatchSizeReport)
- ``render``  the tables as JSON and plots
- ``predicted`` model + Target -> PredictedRow per plan: the tradeoff table for a target that is not here
- ``accuracy``  the prediction for the GPU here beside the same plans run on it (``remat accuracy``)
"""
