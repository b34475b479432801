from tools.testbed.table.cli import main

main()
