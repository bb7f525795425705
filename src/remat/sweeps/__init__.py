"""Features built on the pipeline that plan and measure many steps: the CLI's tradeoff table and the largest batch.

- ``report``  model + budgets -> TradeoffReport: hand rules and remat's plan per budget, each measured
- ``sizing``  budget + make_batch(n) -> BatchSizeReport: the largest and the fastest batch (or sequence) size
  under a budget, confirmed on real steps
- ``search``  the sizes searched on fitted profiles (SizeRow, BatchSizeReport)
- ``render``  the tables as JSON and plots
"""
