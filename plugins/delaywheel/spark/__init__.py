"""The Spark jobs, run by `spark-submit` (delaywheel.airflow.spark.spark_job): files shipped inside the package, not
modules the library imports; each job imports `sparkjob` (passed to Spark with --py-files) and the library."""
