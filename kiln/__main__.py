from kiln.cli import main

raise SystemExit(main())
