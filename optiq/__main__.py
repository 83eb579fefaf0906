from optiq.cli import main

main()
