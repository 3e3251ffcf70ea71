from flatgrad.bench import main

main()
