from flatgrad.bench.cli import main

main()
