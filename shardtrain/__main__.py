from shardtrain.cli.main import main

raise SystemExit(main())
