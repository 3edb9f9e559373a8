"""`python -m rdu.fit`: fit the free constants, print the table, write rdu/fitted.json."""

from rdu.fit.run import main

main()
