"""`kvtierd serve` as a child process, for the tests, the benchmarks and the demo."""
